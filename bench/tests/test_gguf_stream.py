"""bench/bench_gguf_stream.py's GGUF writer and its check against transformers, at a pico shape."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("gguf")

from bench.bench_gguf_stream import compare_with_transformers, write_llama_gguf  # noqa: E402
from gqakit.convert import convert_checkpoint  # noqa: E402


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_the_written_gguf_converts_to_transformers_values(tmp_path: Path, qtype):
    src = tmp_path / "pico.gguf"
    write_llama_gguf(src, {"hidden": 64, "heads": 4, "intermediate": 128, "vocab": 64}, 2, qtype)
    out = convert_checkpoint(src, tmp_path / "out", 4, method="mean", progress=False)
    check = compare_with_transformers(src, out)
    assert check["tensors_compared"] == 2 + 9 * 2 + 1  # embedding, 9 per layer, norm, output
    assert not check["tensors_differing"] and not check["tensors_missing"]
    # the check can fail: a folder of other values differs
    other = tmp_path / "other.gguf"
    write_llama_gguf(other, {"hidden": 64, "heads": 4, "intermediate": 128, "vocab": 64}, 2, qtype, seed=1)
    assert compare_with_transformers(other, out)["tensors_differing"]
