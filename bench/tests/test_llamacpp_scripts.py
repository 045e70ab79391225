"""bench/bench_llamacpp_decode.py's bytes per decode step and bench/bench_llamacpp_check.py's
margin (gqakit's serving check), on pico GGUFs (no llama.cpp needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf")

from bench.bench_gguf_stream import write_llama_gguf  # noqa: E402
from gqakit.engines.check import MARGINS, margin_for  # noqa: E402
from gqakit.eval.measures.serving import gguf_quant  # noqa: E402
from bench.bench_llamacpp_decode import weight_bytes_per_step  # noqa: E402


def test_a_step_reads_every_weight_and_one_embedding_row(tmp_path: Path):
    import gguf

    path = tmp_path / "pico.gguf"
    write_llama_gguf(path, {"hidden": 64, "heads": 4, "intermediate": 128, "vocab": 64}, 2, "F16")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    assert "output.weight" in tensors  # an LM head of its own: of the embedding, one row (64 F16 values)
    assert weight_bytes_per_step(path) == total - int(tensors["token_embd.weight"].n_bytes) + 64 * 2


def test_the_margin_follows_the_coarsest_matmul_weight_type(tmp_path: Path):
    """A GGUF with any quantised matmul weight gets the quantised margin (llama.cpp rounds that
    matmul's activations to 8 bits); an all-float one the float16 margin of llama.cpp's F16 cache."""
    import bench.bench_llamacpp_check as driver

    for wtype, row in [("F16", "float16"), ("Q8_0", "quantised")]:
        path = tmp_path / f"pico-{wtype}.gguf"
        write_llama_gguf(path, {"hidden": 64, "heads": 4, "intermediate": 128, "vocab": 64}, 2, wtype)
        assert margin_for("float32", gguf_quant(tmp_path, path.name))[0] == row
    assert MARGINS["float16"] < MARGINS["quantised"]
    assert not hasattr(driver, "MARGINS")  # the bench driver keeps no margins of its own
