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


def test_activation_rounding_is_llama_cpps_q8_0():
    """bench_llamacpp_rounding rounds a matmul input as llama.cpp's Q8_0 does (gguf's reference
    quantiser): the same values but where llama.cpp's F16 scale rounds differently, by at most one
    step of 2^-11 relative to the scale times 127 steps."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize, quantize

    from bench.bench_llamacpp_rounding import round_like_q8

    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, 128)
    ref = torch.from_numpy(dequantize(quantize(x.numpy().astype(np.float32), QT.Q8_0), QT.Q8_0).copy())
    ours = round_like_q8(x)
    peak = x.reshape(4, 4, 32).abs().amax(-1, keepdim=True).expand(4, 4, 32).reshape(4, 128)
    assert torch.all((ours - ref).abs() <= peak / 127 * (1 + 127 * 2 ** -11))
    # a whole step apart only where the F16 scale moves a value across a rounding boundary: rare
    assert ((ours - ref).abs() <= peak / 127 * 127 * 2 ** -10).float().mean() > 0.95
    assert not torch.equal(ours, x) and (ours - x).abs().max() <= peak.max() / 254 * (1 + 1e-6)
