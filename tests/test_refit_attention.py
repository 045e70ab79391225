"""The reconstruction steps' attention (`calibration.attention.causal_attention`) computes what
transformers' sdpa attention computes, values and gradients, and hands it every call it does not
cover; the attention loss (`loss=attention`) never runs the rest of the block in a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from gqakit.convert.calibration import CalibrationStage
from gqakit.convert.calibration import attention as causal
from gqakit.convert.plan import make_plan
from gqakit.convert.refit_options import RefitOptions
from gqakit.convert.settings import ConvertSettings
from gqakit.convert.source import open_model
from gqakit.core.errors import GqakitError


def _qkv(B, H, KV, T, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, d, generator=g, dtype=torch.float64, requires_grad=True) for n in (H, KV, KV)]


@pytest.mark.parametrize("B, H, KV, T, d, scaling", [
    (2, 6, 2, 300, 32, None),   # three 128-query blocks, the last one short; 3 query heads per KV head
    (2, 6, 2, 300, 16, None),   # narrow heads: five 64-query blocks, the last one short
    (1, 4, 4, 128, 8, 0.3),     # two blocks exactly; no grouping; the scale given
    (3, 8, 1, 129, 4, None),    # one KV head for all; a one-position last block
])
def test_it_equals_sdpa_in_values_and_gradients(B, H, KV, T, d, scaling):
    """In float64 both compute the same sums over at most T = 300 terms in another order: they
    agree to a few ulps of float64 (2e-16 relative each), far inside 1e-10."""
    module = SimpleNamespace(num_key_value_groups=H // KV, is_causal=True)
    q, k, v = _qkv(B, H, KV, T, d)
    g = torch.randn(B, T, H, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine, none = causal.causal_attention(module, q, k, v, None, scaling=scaling)
    assert none is None
    (mine * g).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref, _ = hf_sdpa.sdpa_attention_forward(module, q, k, v, None, scaling=scaling)
    (ref * g).sum().backward()
    assert mine.shape == ref.shape == (B, T, H, d)
    torch.testing.assert_close(mine, ref, rtol=1e-10, atol=1e-12)
    for mg, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(mg, t.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("call", [
    dict(attention_mask=torch.zeros(1, 1, 16, 16)),
    dict(softcap=30.0),
    dict(sliding_window=4),
    dict(dropout=0.1),
    dict(is_causal=False),
])
def test_every_call_it_does_not_cover_goes_to_sdpa(monkeypatch, call):
    seen = []
    monkeypatch.setattr(hf_sdpa, "sdpa_attention_forward", lambda *a, **kw: seen.append(kw) or ("sdpa", None))
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    q, k, v = _qkv(1, 4, 2, 16, 8)
    mask = call.pop("attention_mask", None)
    assert causal.causal_attention(module, q, k, v, mask, **call)[0] == "sdpa"
    assert len(seen) == 1


def test_it_is_installed_over_sdpa_only_and_the_config_is_restored():
    config = SimpleNamespace(_attn_implementation="sdpa")
    with causal.installed(config) as on:
        assert on and config._attn_implementation == causal.NAME
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), causal.installed(config):
        raise RuntimeError("a failed step")
    assert config._attn_implementation == "sdpa"
    eager = SimpleNamespace(_attn_implementation="eager")
    with causal.installed(eager) as on:
        assert not on and eager._attn_implementation == "eager"


def test_the_attention_loss_does_not_train_the_rest_of_the_block():
    with pytest.raises(GqakitError, match="loss=attention .* train=block"):
        RefitOptions.parse({"loss": "attention", "train": "block"})


def _stage(src, **refit):
    settings = ConvertSettings(source=src, num_kv_heads=1, method="align-refit", calibration_tokens=256,
                               grouping="contiguous", refit={"seq_len": 32, "batch": 2, "guard_spans": 2,
                                                             "steps": 24, "lr": 2e-3, **refit})
    opened = open_model(src)
    plan = make_plan(opened, settings)
    return CalibrationStage(opened, plan, plan.settings, device="cpu", progress=False)


@pytest.mark.parametrize("loss, mlp_in_steps", [("attention", False), ("block", True)])
def test_a_step_of_the_attention_loss_runs_no_mlp(tiny_model, one_thread, monkeypatch, loss, mlp_in_steps):
    """The MLP runs with gradients on (a step) only for the block loss; with either loss the
    passes run it (the streams' advance)."""
    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=2)
    stage = _stage(src, loss=loss, train="attention")
    calls = {True: 0, False: 0}
    from transformers.models.llama.modeling_llama import LlamaMLP

    real = LlamaMLP.forward

    def counted(self, x):
        calls[torch.is_grad_enabled()] += 1
        return real(self, x)

    monkeypatch.setattr(LlamaMLP, "forward", counted)
    layers = dict(stage.layers())
    assert len(layers) == 2 and calls[False] > 0
    assert (calls[True] > 0) == mlp_in_steps
    assert stage.summary["options"]["loss"] == loss
    assert all(r["best_step"] > 0 for r in stage.summary["reconstruction"])  # the steps changed the weights


def test_o_projs_refit_after_the_steps_is_kept_only_where_the_guard_prefers_it(tiny_model, one_thread):
    """`final_o`: the same seeded steps, then one more candidate (the trained q, k, v with o_proj in
    closed form on them), kept where its guard loss is lower. The first layer's best guard loss can
    only go down (its inputs are the same), and on a model whose steps are too few to settle o_proj
    the closed form wins; the block loss keeps no targets and takes no such pass."""
    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=2)
    recs = {}
    for loss, final in (("attention", False), ("attention", True), ("block", True)):
        stage = _stage(src, loss=loss, train="attention", final_o=final)
        dict(stage.layers())
        recs[loss, final] = stage.summary["reconstruction"]
        if final and loss == "attention":
            assert "o_proj refitted in closed form after the steps" in stage.describe()
    off, on = recs["attention", False], recs["attention", True]
    assert all("final_o" not in r for r in off + recs["block", True])
    assert on[0]["guard_best"] <= off[0]["guard_best"]
    assert any(r["final_o"] for r in on)
    assert all(r["best_step"] == r["steps_taken"] for r in on if r["final_o"])
