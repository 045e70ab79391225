"""align-refit's reconstruction steps compute the same numbers as a plain per-step path: the
prepared loss (`steploss.SpanLoss`: tensors put into the block once, rows selected only where a
span drops some, streams kept in the step dtype for the layer) gives the same converted model,
bit for bit, as `torch.func.functional_call` on a weights dict rebuilt at every step, with the
streams converted and the rows selected at every step, and the attention loss (`loss=attention`,
the block stopped after its o_proj) the same as the whole block run with o_proj's output taken,
with the K/V heads repeated to the block's count in both."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import gqakit.convert.calibration.refit as refit
import gqakit.convert.calibration.steploss as steploss
from gqakit.convert.calibration.block import Grab
from gqakit.convert.pipeline import convert_checkpoint


class PlainLoss(steploss.SpanLoss):
    """The loss with nothing prepared: every step rebuilds the block's weights dict (the attention
    tensors written in the block's dtype, then converted), reads both streams in the step dtype and
    selects the span's rows with its boolean mask, and calls the block through functional_call."""

    @contextmanager
    def installed(self):
        with steploss.causal.installed(self.blk.attn_config):  # the steps' attention, as the prepared path's
            yield

    def __call__(self, sl, which, current):
        blk, sd, D = self.blk, self.sd, self.D
        heads = self.pooled.replace(**{p: current[p] for p in self.parts})
        w = blk.attention_tensors(heads)
        args, kwargs, positional = self._call(sl.stop - sl.start)
        x = self.ctx.streams.get("new", sl, sd)
        a, k = ((x, *args), kwargs) if positional else ((), {**kwargs, "hidden_states": x})
        weights = self.frozen | {blk.attn_rel[n]: t.to(sd) for n, t in w.items()} | {r: current[r] for r in self.rest}
        grab = Grab(blk.o_mod, output=True)  # the attention's output, the whole block run
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                out = torch.func.functional_call(blk.block, weights, a, k)
        finally:
            grab.remove()
        mask = self.ctx.masks(sl)[which]
        if self.targets is not None:
            t, w = self.targets_of(sl)
            out = grab.rows.reshape(-1, D)[mask].to(sd)
            return ((out - t[mask].to(sd)).pow(2).sum(1) / (D / w[mask].pow(2)).to(sd)).mean()
        out = (out[0] if isinstance(out, tuple) else out).reshape(-1, D)[mask].to(sd)
        y = self.ctx.streams.get("orig", sl, sd).reshape(-1, D)[mask]
        return ((out - y).pow(2).sum(1) / y.pow(2).sum(1).clamp_min(1e-30)).mean()


def _convert(src: Path, out: Path, options: dict) -> dict[str, torch.Tensor]:
    convert_checkpoint(src, out, 2, "align-refit", calibration_tokens=384, progress=False, device="cpu", seed=3,
                       options={"seq_len": 32, "batch": 2, "steps": 12, "guard_spans": 2, "guard_checks": 3,
                                "lr": 0.05, **options})
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.parametrize("options, cache", [
    # the defaults of a small model: the whole block trained, float32 steps over a float64 block;
    # every row kept (no row selection), the streams cached
    ({"train": "block"}, True),
    ({"train": "block"}, False),
    # rows dropped: held-out sequences and the first positions (the masks are applied)
    ({"train": "block", "holdout": 0.25, "skip_first": 3}, True),
    # float64 steps over a float32 block: the attention tensors are rounded to float32 at every step
    ({"train": "attention", "dtype": "float32", "step_dtype": "float64"}, True),
    # bfloat16 autocast over float32 weights and streams; frozen MLP tensors converted once
    ({"train": "attention", "step_dtype": "bfloat16", "holdout": 0.25}, False),
    # the attention loss: the block stopped after o_proj, against the whole block run
    ({"loss": "attention", "holdout": 0.25, "skip_first": 3}, True),
    ({"loss": "attention", "step_dtype": "bfloat16"}, False),
])
def test_the_prepared_steps_equal_the_plain_path_bit_for_bit(tiny_model, tmp_path, monkeypatch, one_thread,
                                                             options, cache):
    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=2)
    if not cache:
        monkeypatch.setattr(steploss, "CACHE_BYTES", 0)
    # the K/V heads repeated, as the plain path has them (the pooled heads as they are change the sums'
    # order: tests/test_refit_compact_kv.py)
    monkeypatch.setattr(steploss.SpanLoss, "_compact_ok", lambda self, *a: False)
    fast = _convert(src, tmp_path / "fast", options)
    monkeypatch.setattr(refit, "SpanLoss", PlainLoss)
    plain = _convert(src, tmp_path / "plain", options)
    assert fast.keys() == plain.keys()
    differ = [n for n in fast if not torch.equal(fast[n].view(torch.uint8), plain[n].view(torch.uint8))]
    assert not differ, differ


def test_the_steps_change_the_weights(tiny_model, tmp_path, one_thread):
    """The comparison above is not vacuous: the steps move the weights away from the closed-form fit."""
    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=2)
    trained = _convert(src, tmp_path / "a", {"train": "block"})
    closed = _convert(src, tmp_path / "b", {"train": "block", "steps": 0})
    assert any(not torch.equal(trained[n], closed[n]) for n in trained if "self_attn" in n)
    assert any(not torch.equal(trained[n], closed[n]) for n in trained if "mlp" in n)


def test_the_block_gets_its_own_parameters_back(tiny_model, tmp_path, monkeypatch, one_thread):
    """During the steps the block holds the step tensors (the float64 block's frozen MLP in float32);
    after an error in them it holds its own parameters again."""
    seen: list[tuple[steploss.SpanLoss, set[torch.dtype]]] = []

    class Failing(steploss.SpanLoss):
        def __call__(self, sl, which, current):
            loss = super().__call__(sl, which, current)
            seen.append((self, {p.dtype for p in self.blk.block.parameters()}))
            if torch.is_grad_enabled():  # the first training step
                raise RuntimeError("inside the steps")
            return loss

    monkeypatch.setattr(refit, "SpanLoss", Failing)
    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=1)
    with pytest.raises(RuntimeError, match="inside the steps"):
        convert_checkpoint(src, tmp_path / "out", 2, "align-refit", calibration_tokens=128, progress=False,
                           device="cpu", options={"seq_len": 32, "batch": 2, "steps": 4, "train": "attention",
                                                  "dtype": "float64"})
    loss, during = seen[-1]
    assert loss.frozen and during == {torch.float32}
    params = dict(loss.blk.block.named_parameters())
    assert params and all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float64 and not p.requires_grad
                          for p in params.values())
