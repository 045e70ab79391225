"""The decode benchmark scripts' own checks: bench.bench_decode_pair and bench.random_model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_pair_bench_refuses_to_write_over_a_model(tiny_model):
    """bench.bench_decode_pair checks --out / --md against the models before anything runs."""
    model = tiny_model("llama", num_key_value_heads=2)
    target = Path(model) / "config.json"
    before = target.read_bytes()
    r = subprocess.run([sys.executable, "-m", "bench.bench_decode_pair", str(model), str(model),
                        "--names", "a,b", "--out", str(target)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "write the results elsewhere" in r.stderr
    assert target.read_bytes() == before


def test_pair_bench_says_when_the_models_ran_different_paths(tiny_model, tmp_path):
    """A speedup between two code paths (here: fused layers for Llama, per-op for Gemma 2) is flagged
    under the table: otherwise a model whose fused step was refused makes the ratio read as a
    memory problem."""
    from gqakit.runtime import kernels as cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip(f"CPU kernels not built here: {cpu_kernels.why_unavailable()}")
    a, b = tiny_model("llama", num_key_value_heads=2), tiny_model("gemma2")
    out, md = tmp_path / "pair.json", tmp_path / "pair.md"
    r = subprocess.run([sys.executable, "-m", "bench.bench_decode_pair", str(a), str(b), "--names", "a,b",
                        "--batch", "1", "--prompt-len", "8", "--new-tokens", "2", "--reps", "1", "--threads", "1",
                        "--out", str(out), "--md", str(md)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = [x for x in json.loads(out.read_text())["rows"] if x["model"] == "b"][0]
    assert row["comparison"]["paths_differ"]["base"][1].startswith("fused")
    assert row["comparison"]["paths_differ"]["other"][1].startswith("per-op")
    assert "b and a ran different decode paths" in md.read_text()


def test_random_model_never_writes_over_a_folder(tmp_path):
    """bench.random_model refuses an OUT that exists, before building anything."""
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = subprocess.run([sys.executable, "-m", "bench.random_model", "gpt2-124m", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "exists" in r.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
