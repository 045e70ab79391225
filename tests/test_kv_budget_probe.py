"""`--kv-budget` with align-refit: the damage probe that measures each candidate after
align-refit's closed-form fits (`convert/budget/refit_probe.py`). Exactness at the source's
heads, the fit's guarantee on the attention output, the record, and the probe's heads against
the conversion's own closed-form fit of a layer whose input is the source's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gqakit.convert.budget.refit_probe import FitOptions, LayerProbe, closed_form_heads
from gqakit.convert.budget.stream import token_loss
from gqakit.convert.calibration.tokens import calibration_sequences
from gqakit.convert.layout import read_heads
from gqakit.convert.refit_options import RefitOptions
from gqakit.convert.source import open_model
from gqakit.core import arch as archmod
from cli_helpers import run_cli
from test_kv_budget import CALIB
from tiny_models import FAMILIES
from tolerance import rounding_tolerance

def calibration_loss(model, seqs, batch: int, device) -> float:
    """Mean next-token loss over `seqs` from full forwards of the model, batch by batch (the
    reference the damage passes, which start at their layer, are compared with)."""
    total, n = 0.0, 0
    with torch.inference_mode():
        for i in range(0, seqs.shape[0], batch):
            t, c = token_loss(model, seqs[i:i + batch].to(device))
            total, n = total + t, n + c
    return total / n


DEFAULTS = FitOptions.of(RefitOptions())  # align-refit's defaults: q_ridge 1e-2, o_ridge 3e-2, relative rows


@pytest.fixture
def llama4(tiny_model, tmp_path):
    """A pico Llama with 8 query heads over 4 KV heads (candidates 4, 2, 1), and calibration text."""
    (tmp_path / "calib.txt").write_text(CALIB)
    return tiny_model("llama", num_key_value_heads=4, num_hidden_layers=3), tmp_path / "calib.txt"


def loaded(src: Path, calib: Path, tokens: int, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    cfg = json.loads((src / "config.json").read_text())
    spec = archmod.lookup(cfg)
    seqs, _ = calibration_sequences(open_model(src), str(calib), tokens, 128, 0, progress=False)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
    return model, spec, archmod.shape_of(spec, cfg), seqs


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])  # separate q/k/v; with biases; fused, o_proj bias
def test_at_the_source_heads_the_fits_leave_the_layer_exact(family, tiny_model, tmp_path, one_thread):
    """G = the source's KV heads: groups of one head are not moved, the query refit's map is the
    identity (its two moments are equal) and the o_proj refit's exact solution is o itself, so the
    fitted layer gives the source's logits, and no loss increase. The fits are float64 (their
    error, ~cond x 2^-53, is far below float32's rounding); the only change the model can see is
    each weight rounded back to float32, one unit roundoff, which moves the logits by at most the
    rounding of the reductions along their path (per layer: hidden, head_dim, the sequence,
    hidden again and the MLP's width; then the head's hidden)."""
    (tmp_path / "calib.txt").write_text(CALIB)
    src = tiny_model(family, **({"num_key_value_heads": 4} if family == "llama" else {}))
    model, spec, shape, seqs = loaded(src, tmp_path / "calib.txt", 1024)
    with torch.inference_mode():
        ref = model(input_ids=seqs).logits
    base = calibration_loss(model, seqs, 4, torch.device("cpu"))
    H, T = shape.hidden_size, seqs.shape[1]
    path = shape.num_layers * (3 * H + shape.head_dim + T + 4 * H) + H  # the MLP's width: at most 4 x hidden
    tol = rounding_tolerance(torch.float32, path, float(ref.abs().max()))
    for layer in range(shape.num_layers):
        probe = LayerProbe(model, spec, shape, layer, seqs, DEFAULTS, batch=4)
        heads = probe.fit(shape.num_kv_heads)
        assert heads.num_kv_heads == shape.num_kv_heads
        probe.put(heads)
        try:
            with torch.inference_mode():
                got = model(input_ids=seqs).logits
            loss = calibration_loss(model, seqs, 4, torch.device("cpu"))
        finally:
            probe.restore()
        torch.testing.assert_close(got, ref, rtol=0, atol=tol)
        # the loss is a mean of log-softmaxes of those logits: it moves by at most the same bound
        assert abs(loss - base) <= tol, (layer, loss - base, tol)


def test_the_fits_lower_the_attention_output_error_below_align(llama4, one_thread):
    """What the o_proj refit minimises, the weighted error of the layer's attention output on the
    calibration rows: with the probe's heads it is at most that of the same heads before the o_proj
    refit (a ridge least-squares fit with that o as a feasible point and the ridge's centre, so
    this holds exactly, up to float64 rounding), and below that of `align`, the closed-form method
    the damages were measured with before (a random pico Llama, 2,048 calibration tokens; the loss
    itself is not what the fit minimises, so the test is on the attention output)."""
    from gqakit.convert.grouping import GROUPINGS
    from gqakit.convert.methods import method_function
    from gqakit.convert.pooling import PoolContext

    src, calib = llama4
    model, spec, shape, seqs = loaded(src, calib, 2048)
    style, rdim = spec.rotary.style, shape.rotary_dim
    align = method_function("align")
    opts = DEFAULTS
    for layer in range(shape.num_layers):
        probe = LayerProbe(model, spec, shape, layer, seqs, opts, batch=8)
        for g in (2, 1):
            fitted = probe.fit(g)
            before = closed_form_heads(probe.heads, g, probe.moment, probe.whiten, spec, shape, opts.q_ridge)
            groups = GROUPINGS["contiguous"](probe.heads, g, rotary_style=style, rotary_dim=rdim)
            aligned = align(probe.heads, PoolContext(g, groups, style, rdim, layer, torch.Generator()))
            err, err_before, err_align = (probe.output_error(h) for h in (fitted, before, aligned))
            assert err <= err_before * (1 + 1e-9), (layer, g, err, err_before)
            assert err < err_align, (layer, g, err, err_align)


def test_a_budget_conversion_with_align_refit_records_its_probe(llama4, tmp_path, capsys, one_thread):
    """`--kv-budget` with align-refit measures the damages with its closed-form fits and says so
    in the record and the plan's lines (`inspect` prints them as the card does)."""
    src, calib = llama4
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", src, out, "--kv-budget", "4/12", "--method", "align-refit",
                            "--calibration-data", calib, "--calibration-tokens", "512",
                            "--refit-option", "steps=0", "-q"], capsys)
    assert code == 0, err
    measured = json.loads((out / "gqakit_convert.json").read_text())["kv_budget"]["measured"]
    assert measured["method"] == "align-refit" and measured["probe"] == "align-refit's closed-form fits"
    code, text, err = run_cli(["inspect", src, "--kv-budget", "0.5", "--method", "align-refit",
                               "--calibration-data", calib, "--calibration-tokens", "512"], capsys)
    assert code == 0, err
    assert "damage measured with align-refit's closed-form fits on" in text


@pytest.mark.parametrize("given", [{}, {"skip_first": 3, "holdout": 0.25, "row_weight": "none", "q_ridge": 0.1}])
def test_the_probe_fits_what_the_conversion_fits_in_its_first_layer(tiny_model, tmp_path, one_thread, given):
    """Layer 0's input is the source's in both: the probe's fitted heads at G=2 are the heads an
    align-refit conversion (closed-form fits only, contiguous groups, float64 throughout) writes
    for layer 0. Both sum the same float64 moments over the same 2,048 rows in a different order
    (batches) and solve the same small systems: relative gaps of ~cond x rows x 2^-53; 1e-9 of
    each tensor's largest magnitude is far above that and far below any difference of method."""
    (tmp_path / "calib.txt").write_text(CALIB)
    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=2, dtype=torch.float64)
    from gqakit.convert.pipeline import convert_checkpoint

    out = convert_checkpoint(src, tmp_path / "g2", 2, "align-refit", grouping="contiguous",
                             calibration_data=str(tmp_path / "calib.txt"), calibration_tokens=2048,
                             options={"steps": 0, "dtype": "float64", "stream_dtype": "float64", "batch": 4, **given},
                             device="cpu", progress=False)
    model, spec, shape, seqs = loaded(src, tmp_path / "calib.txt", 2048, torch.float64)
    opts = FitOptions.of(RefitOptions(**given))
    got = LayerProbe(model, spec, shape, 0, seqs, opts, batch=8).fit(2)
    written = load_file(str(next(out.glob("*.safetensors"))))
    want = read_heads(spec, archmod.shape_of(spec, json.loads((out / "config.json").read_text())), written, 0,
                      dtype=torch.float64)
    for part in ("q", "k", "v", "o"):
        a, b = getattr(got, part), getattr(want, part)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9 * float(b.abs().max()), msg=part)
    # the test can fail: another G's fit, or the fit without the query refit, is far from it
    other = LayerProbe(model, spec, shape, 0, seqs, dataclasses.replace(opts, q_ridge=-1), batch=8).fit(2)
    assert (other.q - want.q).abs().max() > 1e-3 * want.q.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_damages_started_at_each_layer_equal_full_forwards(family, tiny_model, tmp_path, one_thread):
    """The damage passes start at the measured layer, on the source's hidden state kept batch by
    batch (`stream.SourceStream`): the blocks before it are not run again. The same inputs go
    through the same operations as in a full forward of the model, so both probes' damages equal,
    bit for bit, the losses of full forwards with the candidate written into the model (every
    family of the table: blocks that return a tuple or a tensor, hidden states given by position
    or by keyword, logits transformed after the head)."""
    from gqakit.convert.budget.damage import _write, layer_heads, measure_damage
    from gqakit.convert.budget.refit_probe import measure_refit_damage
    from gqakit.convert.methods import method_function

    (tmp_path / "calib.txt").write_text(CALIB)
    src = tiny_model(family)
    cfg = json.loads((src / "config.json").read_text())
    spec = archmod.lookup(cfg)
    shape = archmod.shape_of(spec, cfg)
    if shape.num_kv_heads < 2:
        pytest.skip("one KV head: nothing to measure")
    model, spec, shape, seqs = loaded(src, tmp_path / "calib.txt", 1024)
    batch, cands = 3, [shape.num_kv_heads, 1]  # 3 does not divide the sequences: a short last batch
    base = calibration_loss(model, seqs, batch, torch.device("cpu"))
    got = measure_refit_damage(model, spec, shape, seqs, options=DEFAULTS, candidates=cands, batch=batch,
                               progress=False)
    assert got.base_loss == base
    params = dict(model.named_parameters())
    for layer in range(shape.num_layers):
        probe = LayerProbe(model, spec, shape, layer, seqs, DEFAULTS, batch=batch)
        probe.put(probe.fit(1))
        try:
            want = calibration_loss(model, seqs, batch, torch.device("cpu")) - base
        finally:
            probe.restore()
        assert got.per_layer[layer][1] == want, (layer, got.per_layer[layer][1], want)
    got = measure_damage(model, spec, shape, seqs, method="mean", candidates=cands, batch=batch, progress=False)
    fn = method_function("mean")
    for layer in range(shape.num_layers):
        saved, heads = layer_heads(model, spec, shape, layer, params)
        _write(params, spec, shape, layer, heads, 1, fn, torch.Generator(), saved)
        try:
            want = calibration_loss(model, seqs, batch, torch.device("cpu")) - base
        finally:
            with torch.no_grad():
                for n, t in saved.items():
                    params[n].copy_(t)
        assert got.per_layer[layer][1] == want, (layer, got.per_layer[layer][1], want)
        assert want != 0.0  # the candidate changes the model: a pass that ignored it would fail above
