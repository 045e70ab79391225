"""The engine seam of `gqakit eval --speed`: the registry, its one-line errors, and
`EngineBench`, which runs the decode grid on any engine (here a fake one with fixed timings
and KV allocation, registered under the vllm name, and the real transformers engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import fake_engine
from cli_helpers import assert_one_line_error, run_cli
from gqakit.core.errors import GqakitError
from gqakit.engines import ENGINES, NEEDS, EngineMissing, EngineOptions, get_engine

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")






TORCH_FREE = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
import gqakit.engines as e
from gqakit.engines.base import EngineOptions
print(",".join(e.ENGINES), EngineOptions(dtype="bf16").dtype)
"""


def test_import_gqakit_engines_imports_no_torch():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, env=env,
                         cwd=REPO.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["gqakit,transformers,vllm,llama.cpp", "bfloat16"]


def test_the_settings_and_the_flag_offer_the_registry_engines():
    from gqakit.eval.measures.speed import ENGINE_NAMES, engine_help
    from gqakit.eval.speed.settings import SpeedSettings

    literal = typing.get_args(SpeedSettings.model_fields["engine"].annotation)
    assert literal == ENGINE_NAMES == tuple(ENGINES)
    assert SpeedSettings().engine == "gqakit"
    assert all(n in engine_help() and NEEDS[n] in engine_help() for n in ENGINES)
    with pytest.raises(GqakitError, match="--engine must be one of"):
        SpeedSettings(engine="tensorrt")
    with pytest.raises(GqakitError, match="--compile, --max-batch-search: for the gqakit and transformers"):
        SpeedSettings(engine="vllm", compile=True, max_batch_search=True)


def test_help_lists_the_engines_and_what_each_needs(capsys):
    code, out, _ = run_cli(["eval", "--help"], capsys)
    assert code == 0
    flat = " ".join(out.split())
    assert "--engine" in flat and "scripts/engines.sh vllm" in flat and "llama-cpp-python" in flat
    assert "--check" in flat


def test_registry_errors_are_one_line(monkeypatch):
    with pytest.raises(GqakitError, match="no engine named 'tensorrt'; engines: gqakit, transformers, vllm, llama.cpp"):
        get_engine("tensorrt")
    monkeypatch.setitem(ENGINES, "llama.cpp", "missing_engine:Engine")
    with pytest.raises(EngineMissing, match="needs llama-cpp-python.*is not importable"):
        get_engine("llama.cpp")
    with pytest.raises(GqakitError, match="engine max_len"):
        EngineOptions(max_len=0)
    with pytest.raises(GqakitError, match="engine dtype"):
        EngineOptions(dtype="int3")


def test_missing_engine_is_exit_2_before_the_model_loads(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(ENGINES, "llama.cpp", "missing_engine:Engine")
    model = tiny_model("llama")
    code, _, err = run_cli(["eval", model, "--speed", "--engine", "llama.cpp", "--batch", "1", "--prompt-len", "8",
                            "--new-tokens", "2", "--out", tmp_path / "r.json"], capsys)
    assert_one_line_error(code, err, "the llama.cpp engine needs llama-cpp-python")
    assert not (tmp_path / "r.json").exists()
    code, _, err = run_cli(["eval", model, "--speed", "--engine", "tensorrt", "--out", tmp_path / "r.json"], capsys)
    assert_one_line_error(code, err, "--engine")


def test_engine_bench_points_carry_the_engine_timings_and_allocation(tiny_model, tmp_path, capsys, monkeypatch):
    """A fake engine under the vllm name: its fixed timings and KV allocation reach every point,
    the results file, the printed summary and compare's report; the prediction comes from the
    model's geometry, as for every engine."""
    monkeypatch.setitem(ENGINES, "vllm", "fake_engine:FakeEngine")
    fake_engine.FakeEngine.calls.clear()
    model = tiny_model("llama", num_key_value_heads=2)
    out = tmp_path / "fake.json"
    code, stdout, err = run_cli(["eval", model, "--speed", "--engine", "vllm", "--batch", "1,2", "--prompt-len", "8",
                                 "--new-tokens", "3", "--reps", "2", "--warmup", "1", "--out", out, "-q"], capsys)
    assert code == 0, err
    assert ("load", str(model), 8 + 3, 2) in fake_engine.FakeEngine.calls
    assert ("time_point", 2, 8, 3, 2, 1) in fake_engine.FakeEngine.calls and fake_engine.FakeEngine.calls[-1] == ("close",)
    data = json.loads(out.read_text())
    speed = data["speed"]
    assert speed["settings"]["engine"] == "vllm"
    assert speed["settings"]["engine_kv"]["bytes_per_token"] == fake_engine.KV_PER_TOKEN
    predicted = 2 * 2 * 2 * 4 * 4  # K and V, 2 layers, 2 KV heads, head_dim 4, float32: the geometry's, not the engine's
    assert speed["kv_bytes_per_token"] == predicted
    for g in speed["grid"]:
        assert g["status"] == "ok" and g["engine"] == "fake"
        assert g["engine_kv"]["bytes_per_token"] == fake_engine.KV_PER_TOKEN
        assert g["engine_kv"]["detail"] == {"block_size": 16}
        assert g["kv_cache_bytes"] == fake_engine.KV_PER_TOKEN * fake_engine.CAPACITY
        assert g["decode_ms_per_token"]["median"] == pytest.approx(1e3 * fake_engine.DECODE_S)
        assert g["tokens_per_s"]["median"] == pytest.approx(g["batch"] / fake_engine.DECODE_S)
        assert g["prefill_ms"]["median"] == pytest.approx(1e3 * fake_engine.PREFILL_S)
        assert g["decode_samples"] == 3 * 2 and g["prefill_samples"] == 2
        # the roofline view: bytes a step must read from the model's geometry
        assert g["bytes_per_step"]["kv"] == pytest.approx(g["batch"] * predicted * (8 + (3 + 1) / 2))
        assert g["roofline_fraction"] > 0
    assert "engine: vllm" in stdout and f"{fake_engine.KV_PER_TOKEN} B/token" in stdout
    code, _, err = run_cli(["compare", out, out, "--names", "a,b", "--out", tmp_path / "rep"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    row = report["rows"][0]
    assert row["engine"] == "vllm"
    assert row["speed"]["b2_p8"]["tokens_per_s"] == pytest.approx(2 / fake_engine.DECODE_S)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| engine |" in md.replace("engine | tok/s", "engine |")


def test_engine_bench_on_the_real_transformers_engine(tiny_model):
    """EngineBench over the transformers engine: the allocation it reports is its static
    cache's real bytes, equal to the geometry's prediction."""
    import torch

    from gqakit.core.loading import load_causal_lm
    from gqakit.eval.speed.engine_bench import EngineBench
    from gqakit.eval.speed.roofline import measure_roof

    path = tiny_model("llama", num_key_value_heads=2)
    engine = get_engine("transformers")
    engine.load(path, EngineOptions(max_len=16))
    bench = EngineBench(engine, load_causal_lm(path), device="cpu", dtype=torch.float32)
    assert bench.allocation.bytes_per_token == bench.kv_bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert bench.allocation.total_bytes == 16 * bench.kv_bytes_per_token
    point = bench.run_point(2, 8, 3, 2, 1, measure_roof("cpu", torch.float32))
    assert point.status == "ok" and point.engine == "transformers" and point.decode_samples == 6
    with pytest.raises(GqakitError, match="cannot alternate"):
        bench.begin_rep(bench.open_point(1, 8, 2, 0))


def test_transformers_engine_is_the_stock_path_and_says_so(tiny_model, tmp_path, capsys):
    model = tiny_model("llama", num_key_value_heads=2)
    out = tmp_path / "t.json"
    code, stdout, err = run_cli(["eval", model, "--speed", "--engine", "transformers", "--batch", "1", "--prompt-len",
                                 "8", "--new-tokens", "2", "--reps", "1", "--warmup", "0", "--out", out], capsys)
    assert code == 0, err
    data = json.loads(out.read_text())["speed"]
    assert data["settings"]["engine"] == "transformers"
    assert data["attention"]["implementation"] == "sdpa"  # transformers' own attention, not gqakit_sdpa
    assert data["grid"][0]["packed_weight_bytes"] in (0, None) and data["grid"][0]["engine"] == "transformers"
    assert "stock transformers" in stdout


def test_compare_says_plainly_when_transformers_shows_little_gain():
    from gqakit.eval.report import little_gain_warnings
    from gqakit.eval.report_rows import ReportRow, SpeedEntry

    def row(name, engine, speedup, predicted, noise=False):
        share = (speedup - 1) / (predicted - 1)
        entry = SpeedEntry.model_construct(batch=8, prompt_len=1024, status="ok", speedup=speedup,
                                           predicted_speedup_bytes=predicted, share_of_predicted=share,
                                           speedup_within_noise=noise)
        return ReportRow.model_construct(name=name, engine=engine, speed={"b8_p1024": entry})

    base = row("mha", "transformers", 1.0, 1.0001)
    little = little_gain_warnings([base, row("g1", "transformers", 1.05, 1.42)], "mha")
    assert len(little) == 1 and "g1 on the transformers engine shows little" in little[0]
    assert "b8_p1024 1.05x of 1.42x" in little[0]
    assert little_gain_warnings([base, row("g1", "transformers", 1.36, 1.42)], "mha") == []  # most of it
    assert little_gain_warnings([base, row("g1", "gqakit", 1.05, 1.42)], "mha") == []       # another engine
    assert little_gain_warnings([base, row("g1", "transformers", 1.0, 1.01)], "mha") == []  # nothing to show
    assert len(little_gain_warnings([base, row("g1", "transformers", 1.3, 1.42, noise=True)], "mha")) == 1


def test_an_engine_that_states_its_own_bytes_prices_the_steps_with_them(tiny_model, tmp_path, capsys, monkeypatch):
    """llama.cpp reads a quantised GGUF's weights as stored and keeps an F16 cache: an engine
    with `step_bytes` has its points' bytes (and the prediction built on them) from its own
    storage, not from the float32 model transformers dequantises."""
    monkeypatch.setitem(ENGINES, "vllm", "fake_engine:StoringEngine")
    model = tiny_model("llama", num_key_value_heads=2)
    out = tmp_path / "storing.json"
    code, _, err = run_cli(["eval", model, "--speed", "--engine", "vllm", "--batch", "1", "--prompt-len", "8",
                            "--new-tokens", "3", "--reps", "1", "--warmup", "0", "--out", out, "-q"], capsys)
    assert code == 0, err
    speed = json.loads(out.read_text())["speed"]
    assert speed["kv_bytes_per_token"] == fake_engine.STEP_KV_PER_TOKEN
    g = speed["grid"][0]
    assert g["bytes_per_step"]["weights"] == fake_engine.STEP_WEIGHT_BYTES
    assert g["bytes_per_step"]["kv"] == pytest.approx(fake_engine.STEP_KV_PER_TOKEN * (8 + (3 + 1) / 2))
