"""align-refit's steps compute the pooled K/V heads once each (`SpanLoss.compact`) where the block's
attention takes them so: the loss and its gradients equal those of the K/V heads repeated to the
block's count within the rounding of the step dtype, and a block that does not take them (a fused
QKV projection split by the source's head count) keeps the repeated heads, bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_refit_steploss import _convert

import gqakit.convert.calibration.refit as refit
import gqakit.convert.calibration.steploss as steploss

STEPS = 12  # the steps per layer of `_convert`


class Both(steploss.SpanLoss):
    """At every training step, the loss and its gradients computed both ways."""

    pairs: list[tuple] = []
    decided: list[bool] = []

    def _compact_ok(self, sl, which, current):
        ok = super()._compact_ok(sl, which, current)
        Both.decided.append(ok)
        return ok

    def __call__(self, sl, which, current):
        loss = super().__call__(sl, which, current)
        if torch.is_grad_enabled() and self.compact:
            params = [current[p] for p in self.parts]
            got = torch.autograd.grad(loss, params, retain_graph=True)
            out, y, den = self._out(sl, which, current, expand=True, autocast=self.autocast)
            ref_loss = ((out - y).pow(2).sum(1) / den).mean()
            ref = torch.autograd.grad(ref_loss, params)
            n = self.D + self.ctx.streams.orig.shape[1]
            Both.pairs.append((float(loss.detach()), float(ref_loss.detach()), got, ref, self.sd, n))
        return loss


@pytest.mark.parametrize("family, overrides, options", [
    ("llama", {"num_key_value_heads": 4}, {"train": "attention", "step_dtype": "float32"}),
    ("qwen2", {"num_key_value_heads": 4}, {"loss": "attention"}),   # K/V biases
    ("olmo2", {}, {"train": "block"}),                                  # a k_norm over the whole K projection
])
def test_the_pooled_heads_give_the_repeated_heads_loss_and_gradients(tiny_model, tmp_path, monkeypatch, one_thread,
                                                                     family, overrides, options):
    Both.pairs, Both.decided = [], []
    monkeypatch.setattr(refit, "SpanLoss", Both)
    _convert(tiny_model(family, **overrides), tmp_path / "out", options)
    assert Both.decided and all(Both.decided)
    assert len(Both.pairs) == STEPS * len(Both.decided)  # every step of every layer compared
    for loss, ref_loss, got, ref, sd, n in Both.pairs:
        # the same sums in another order: within 16 n units of rounding, relative to the largest value
        tol = 16 * n * torch.finfo(sd).eps / 2
        assert abs(loss - ref_loss) <= tol * abs(ref_loss)
        for a, b in zip(got, ref, strict=True):
            assert (a - b).abs().max() <= tol * b.abs().max()


def test_a_fused_projection_keeps_the_repeated_heads_bit_for_bit(tiny_model, tmp_path, monkeypatch, one_thread):
    """GPT-2's c_attn splits [q|k|v] by the source's head count: the check refuses the pooled heads,
    and the conversion is the one with the repeated heads, bit for bit."""
    src = tiny_model("gpt2")
    Both.pairs, Both.decided = [], []
    monkeypatch.setattr(refit, "SpanLoss", Both)
    got = _convert(src, tmp_path / "a", {})
    assert Both.decided and not any(Both.decided)
    monkeypatch.setattr(steploss.SpanLoss, "_compact_ok", lambda self, *a: False)
    ref = _convert(src, tmp_path / "b", {})
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[n].view(torch.uint8), ref[n].view(torch.uint8)) for n in got)


def test_the_check_refuses_heads_that_differ(tiny_model, tmp_path, monkeypatch, one_thread):
    """The check is not vacuous: pooled heads whose outputs differ from the repeated ones' (here, the
    two pooled K/V heads swapped, as a block that grouped the query heads otherwise would) are refused."""
    Both.pairs, Both.decided = [], []
    monkeypatch.setattr(refit, "SpanLoss", Both)
    real = steploss.SpanLoss._out

    def skewed(self, sl, which, current, *, expand, autocast):
        if expand:
            return real(self, sl, which, current, expand=expand, autocast=autocast)
        cur = dict(current, k=current["k"].flip(0), v=current["v"].flip(0))
        return real(self, sl, which, cur, expand=expand, autocast=autocast)

    monkeypatch.setattr(steploss.SpanLoss, "_out", skewed)
    _convert(tiny_model("llama", num_key_value_heads=4), tmp_path / "out", {"train": "attention"})
    assert Both.decided and not any(Both.decided)


def test_a_block_that_raises_on_the_pooled_heads_keeps_the_repeated_ones(tiny_model, tmp_path, monkeypatch,
                                                                         one_thread):
    """Whatever a block's code raises on the pooled heads (an assert on the KV count, here), the
    conversion goes on with the repeated heads."""
    Both.pairs, Both.decided = [], []
    monkeypatch.setattr(refit, "SpanLoss", Both)
    real = steploss.SpanLoss._out

    def strict(self, sl, which, current, *, expand, autocast):
        assert expand, "this block takes its source's KV head count"
        return real(self, sl, which, current, expand=expand, autocast=autocast)

    monkeypatch.setattr(steploss.SpanLoss, "_out", strict)
    _convert(tiny_model("llama", num_key_value_heads=4), tmp_path / "out", {"train": "attention"})
    assert Both.decided and not any(Both.decided)
