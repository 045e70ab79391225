"""bench/bench_llamacpp_decode.py's bytes per decode step and bench/bench_llamacpp_check.py's
choice of margin, on pico GGUFs (no llama.cpp needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf")

from bench.bench_gguf_stream import write_llama_gguf  # noqa: E402
from bench.bench_llamacpp_check import MARGINS, matmul_type  # noqa: E402
from bench.bench_llamacpp_decode import weight_bytes_per_step  # noqa: E402


def test_a_step_reads_every_weight_and_one_embedding_row(tmp_path: Path):
    import gguf

    path = tmp_path / "pico.gguf"
    write_llama_gguf(path, {"hidden": 64, "heads": 4, "intermediate": 128, "vocab": 64}, 2, "F16")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    assert "output.weight" in tensors  # an LM head of its own: of the embedding, one row (64 F16 values)
    assert weight_bytes_per_step(path) == total - int(tensors["token_embd.weight"].n_bytes) + 64 * 2


def test_the_margin_follows_the_most_common_weight_type():
    assert matmul_type({"F32": 61, "Q4_1": 210, "F16": 1}) == "Q4_1" and MARGINS["Q4_1"] > MARGINS["F32"]
