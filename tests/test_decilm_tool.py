"""The rest of the tool reads a per-layer model (the nemotron-nas folder a --kv-plan writes):
eval's perplexity and KV bytes, the speed bench's cache price, compare, and uptrain (full,
LoRA, resume after a kill)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gqakit
from test_kv_plan import HEADS, LAYERS, PLAN, convert, plan_file, pooled_reference
from test_uptrain_resume import test_resume_after_sigkill_matches_one_go_run as resume_matches_one_go
from test_uptrain_resume import write_cfg

TEXT = " ".join(chr(33 + (i * 11) % 61) for i in range(400))
HEAD_DIM = 32 // HEADS
PLAN_BYTES = 2 * sum(PLAN) * HEAD_DIM * 4  # K and V, each layer's own heads, float32


@pytest.fixture
def per_layer(tiny_model, tmp_path: Path) -> Path:
    return convert(tiny_model("llama", num_hidden_layers=LAYERS), tmp_path / "plan-out",
                   kv_plan=plan_file(tmp_path, PLAN))


def test_eval_perplexity_and_kv_bytes(per_layer, tiny_model, tmp_path):
    res = gqakit.evaluate(per_layer, text=TEXT, context=32, stride=16, dtype="float32", quiet=True)
    assert res.model.kv_bytes_per_token == PLAN_BYTES  # summed over layers, not the largest layer's × layers
    # the same function as the source with those layers' heads pooled and repeated back
    src = tiny_model("llama", num_hidden_layers=LAYERS)
    pooled_reference(src, PLAN).save_pretrained(tmp_path / "reference")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "reference" / f).write_bytes((src / f).read_bytes())
    ref = gqakit.evaluate(tmp_path / "reference", text=TEXT, context=32, stride=16, dtype="float32", quiet=True)
    # float32 logits that agree to rounding (tests/test_kv_plan.py) give perplexities within 1e-5 relative
    assert res.perplexity.token_perplexity == pytest.approx(ref.perplexity.token_perplexity, rel=1e-5)
    assert ref.model.kv_bytes_per_token == 2 * LAYERS * HEADS * HEAD_DIM * 4


def test_compare_reports_per_layer_bytes(per_layer, tmp_path):
    from gqakit.eval.results import read_results
    from gqakit.eval.report import make_report

    out = tmp_path / "r.json"
    gqakit.evaluate(per_layer, text=TEXT, context=32, stride=16, dtype="float32", quiet=True, out=out)
    report = make_report([read_results(out)], ["per-layer"])
    assert report.rows[0].kv_bytes_per_token == PLAN_BYTES


def test_speed_bench_prices_each_layers_cache(per_layer):
    from gqakit.core.loading import load_causal_lm
    from gqakit.eval.speed.bench import DecodeBench

    model = load_causal_lm(per_layer).eval()
    bench = DecodeBench(model, device=torch.device("cpu"), dtype=torch.float32)
    assert bench.kv_bytes_per_token == PLAN_BYTES


@pytest.mark.parametrize("train", [{}, {"lora": {"r": 4}}], ids=["full", "lora"])
def test_uptrain_two_steps(per_layer, tmp_path, train):
    from gqakit.core.loading import load_causal_lm
    from gqakit.uptrain import run_uptrain

    cfg = write_cfg(tmp_path / "u.yaml", per_layer, tmp_path / "run", 2, **train)
    run_uptrain(cfg, [])
    model = load_causal_lm(tmp_path / "run" / "model")
    assert [layer.self_attn.k_proj.out_features // HEAD_DIM for layer in model.model.layers] == PLAN
    cfg_out = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert [HEADS // b["attention"]["n_heads_in_group"] for b in cfg_out["block_configs"]] == PLAN


@pytest.mark.slow  # the resume path of tests/test_uptrain_resume.py, on a per-layer model
def test_uptrain_resumes_exactly_after_kill(request, tmp_path):
    resume_matches_one_go("per_layer", request, tmp_path, 120, {})
