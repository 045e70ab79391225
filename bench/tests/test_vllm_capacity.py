"""bench/bench_vllm_capacity.py: its summary without vLLM, and one small run
under the `engines` marker (vLLM from .venv-vllm or GQAKIT_VLLM_PYTHON)."""

from __future__ import annotations

import json

import pytest

from bench import bench_vllm_capacity as cap
from gqakit.engines import EngineMissing
from gqakit.engines.vllm import find_python


def test_there_is_one_serving_check():
    """The bench scores through gqakit's serving check, its margins and rule, not a copy of its own."""
    import inspect

    from gqakit.engines import check

    src = inspect.getsource(cap)
    assert "check import run_check" in src and "NEAR_TIE" not in src and "def score" not in src
    assert not hasattr(cap, "MARGINS") and check.margin_for("float32")[0] == "float32"


def test_summary_compares_concurrency_and_throughput_with_the_bytes():
    def model(kv, blocks, conc, tput):
        return {"kv_bytes_per_token": kv, "num_blocks": blocks, "concurrency": conc,
                "throughput_tok_s": {"median": tput, "min": tput * 0.9, "max": tput * 1.1}}

    s = cap.summarize({"original": model(46080, 11, 5.5, 10.0), "converted": model(15360, 34, 17.0, 25.0)}, 32)
    assert s["kv_bytes_ratio"] == 3.0 and s["concurrency_within_a_block"]
    assert s["running_at_once"] == {"original": 5, "converted": 17}
    assert s["throughput_ratio_predicted_max"] == 17 / 5 and s["throughput_ratio"] == 2.5
    assert s["throughput_ratio_range"] == pytest.approx([22.5 / 11.0, 27.5 / 9.0])
    off = cap.summarize({"original": model(46080, 11, 5.5, 10.0), "converted": model(15360, 36, 18.0, 25.0)}, 32)
    assert not off["concurrency_within_a_block"]  # 36 blocks is more than one block off 3 x 11


def test_workload_prompts_are_distinct_and_avoid_special_ids():
    p = cap.workload_prompts(8, 16, 64)
    assert len({tuple(x) for x in p}) == 8 and all(3 <= t < 64 for x in p for t in x)
    assert cap.workload_prompts(8, 16, 64, seed=1) != p


@pytest.mark.engines
def test_small_run_writes_the_results(tiny_model, tmp_path):
    try:
        find_python()
    except EngineMissing:
        pytest.skip("vLLM not found (bash scripts/engines.sh vllm, or GQAKIT_VLLM_PYTHON)")
    orig = tiny_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=4)
    conv = tiny_model("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    out = tmp_path / "cap.json"
    cap.main([str(orig), str(conv), "--kv-budget", "1MiB", "--requests", "4", "--prompt", "16", "--output", "4",
              "--runs", "1", "--check-prompts", "2", "--check-length", "8", "--check-tokens", "4", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["summary"]["kv_bytes_ratio"] == 2.0 and r["summary"]["blocks_ratio"] == 2.0
    for m in r["models"].values():
        assert m["check"]["passed"] and m["check"]["kv"]["match"] and m["check"]["positions"] == 8
        assert m["kv_bytes_predicted"] == m["kv_bytes_per_token"] and len(m["seconds"]) == 1
