"""bench/bench_llamacpp_decode.py's sweep: the bytes of a decode step, the attention arithmetic
per cached byte, the memory-bound classification and the ratios against the prediction, the
random MHA GGUF (read back by gguf and by llama.cpp), and the rewound decode steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from bench.bench_llamacpp_decode import weight_bytes_per_step  # noqa: E402
from bench.llamacpp_sweep import (macs_per_cache_byte, markdown_table, mean_depth, parse_mha, step_bytes,  # noqa: E402
                                  summarize_point, write_random_mha)

REPO = Path(__file__).resolve().parents[2]


def test_the_shape_of_a_random_mha_source():
    s = parse_mha("12x768x12")
    assert s == {"layers": 12, "hidden": 768, "heads": 12, "head_dim": 64, "intermediate": 2048, "vocab": 32000}
    assert parse_mha("32x4096x32")["intermediate"] == 11008  # Llama-2-7B's: 8/3 x 4096 rounded up to 256s
    for bad in ("12x768", "12x768x10", "0x64x4", "2x12x4"):  # not three numbers; 76.8; zero; head size 3 (odd)
        with pytest.raises(ValueError):
            parse_mha(bad)


def test_bytes_of_a_step_at_the_mean_depth():
    """Step i after D prompt tokens attends over D + i + 1 cached positions: the mean over the N
    steps, summed one by one, is what step_bytes charges."""
    weights, per_token, depth, n = 1_000_003, 4608, 4096, 64
    one_by_one = sum(weights + (depth + i + 1) * per_token for i in range(n)) / n
    assert step_bytes(weights, per_token, depth, n) == int(one_by_one)
    assert mean_depth(depth, n) == depth + 32.5


def test_attention_work_per_cached_byte():
    assert macs_per_cache_byte(12, 12) == 0.5  # MHA, F16: one query head per cached K/V head
    assert macs_per_cache_byte(9, 3) == 1.5  # SmolLM2's 9 query heads on 3 KV heads
    assert macs_per_cache_byte(9, 1) == 4.5  # ... converted to G = 1: three times the work per byte
    assert macs_per_cache_byte(12, 12, 1) == 1.0  # an 8-bit cache


def point(orig_tok: list[float], conv_tok: list[float], copy: list[float], threshold: float = 0.8) -> dict:
    models = {"original": {"tok_per_s": orig_tok, "bytes_per_step": 400_000_000, "kv_heads": 12},
              "g1": {"tok_per_s": conv_tok, "bytes_per_step": 250_000_000, "kv_heads": 1}}
    return summarize_point(models, copy, threshold)


def test_a_point_is_memory_bound_when_the_original_nears_copy_bandwidth():
    # the original moves 400 MB per step: 20 tok/s = 8 GB/s against a 10 GB/s copy: 0.8 of it
    p = point([19.0, 20.0, 21.0], [30.0, 30.4, 33.6], [10.0, 10.0, 10.0])
    o, c = p["models"]["original"], p["models"]["g1"]
    assert o["gbs_per_round"] == pytest.approx([7.6, 8.0, 8.4]) and o["of_copy"] == pytest.approx(0.8)
    assert p["memory_bound"] and p["threshold"] == 0.8
    assert c["predicted_ratio"] == pytest.approx(1.6)  # 400 MB / 250 MB
    assert c["ratio_per_round"] == pytest.approx([30 / 19, 1.52, 1.6]) and c["ratio"] == pytest.approx(30 / 19)
    assert c["of_prediction"] == pytest.approx(30 / 19 / 1.6)
    assert not point([19.0, 20.0, 21.0], [30.0, 30.4, 33.6], [10.0, 10.0, 10.0], threshold=0.85)["memory_bound"]
    # the same speeds beside a copy twice as fast: half of it, compute-bound
    assert not point([19.0, 20.0, 21.0], [30.0, 30.4, 33.6], [20.0, 20.0, 20.0])["memory_bound"]


def test_each_round_is_set_against_its_own_copy_bandwidth():
    p = point([10.0, 20.0, 20.0], [16.0, 16.0, 32.0], [5.0, 10.0, 10.0])
    assert p["models"]["original"]["of_copy_per_round"] == pytest.approx([0.8, 0.8, 0.8])
    assert p["memory_bound"] and p["copy_gbs_median"] == 10.0
    assert p["models"]["g1"]["ratio"] == pytest.approx(1.6)  # median of 1.6, 0.8, 1.6: rounds paired, not pooled
    with pytest.raises(ValueError):
        point([10.0, 20.0], [16.0, 16.0], [5.0, 10.0, 10.0])


def test_the_table_has_a_row_per_model_and_point():
    p = {"source": "m.gguf", "depth": 4096, "threads": 2, **point([20.0], [32.0], [10.0])}
    lines = markdown_table([p]).splitlines()
    assert len(lines) == 4 and all(line.count("|") == 14 for line in lines)
    assert "| g1 | 1 | 2 | 4096 | 32.0 | 32.0 | 8.00 (80%) | 10.0 | yes | 1.60x | 1.60x | 100% |" in lines[3]


def test_the_random_mha_gguf_has_its_heads_and_no_zero_weights(tmp_path: Path):
    import numpy as np
    from gguf import GGUFReader

    shape = parse_mha("2x128x4", vocab=512)
    path = write_random_mha(tmp_path / "mha.gguf", shape, seed=3)
    r = GGUFReader(path)

    def field(name: str):
        f = r.fields[name]
        return f.parts[f.data[0]][0]

    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "llama"
    assert field("llama.attention.head_count") == field("llama.attention.head_count_kv") == 4
    assert field("llama.block_count") == 2 and field("llama.embedding_length") == 128
    assert field("llama.rope.dimension_count") == 32 and field("llama.feed_forward_length") == 512  # 8/3 x 128 -> 512
    tensors = {t.name: t for t in r.tensors}
    assert tensors["blk.1.attn_k.weight"].tensor_type.name == "F16"
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 512
    assert all(np.abs(np.asarray(t.data, dtype=np.float32)).sum() > 0 for t in r.tensors)
    again = write_random_mha(tmp_path / "again.gguf", shape, seed=3)
    assert again.read_bytes() == path.read_bytes()  # a fixed seed: the same file


def test_a_conversion_drops_exactly_the_kv_rows(tmp_path: Path):
    """G = 1 of an F16 MHA source: each layer's K and V lose (H - 1) x head_dim rows of HIDDEN F16 values."""
    from gqakit.convert import convert_gguf

    shape = parse_mha("2x128x4", vocab=512)
    src = write_random_mha(tmp_path / "mha.gguf", shape)
    out = tmp_path / "g1.gguf"
    convert_gguf(src, out, 1, "mean", progress=False)
    dropped = shape["layers"] * 2 * (4 - 1) * shape["head_dim"] * shape["hidden"] * 2
    assert weight_bytes_per_step(src) - weight_bytes_per_step(out) == dropped


def test_rewound_steps_decode_at_the_same_depth_every_round(tmp_path: Path):
    """The driver's timed steps start at depth D each time (llama.cpp's cache holds D + N cells
    after every call, never more), on the threads asked for."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from bench.bench_llamacpp_decode import load_and_fill, time_decode

    src = write_random_mha(tmp_path / "mha.gguf", parse_mha("2x128x4", vocab=512))
    engine, info = load_and_fill(src, 40, 6, threads=1)
    try:
        assert info["kv_heads"] == 4 and info["kv_bytes_per_token"] == info["kv_predicted"] == 2 * 2 * 128 * 2
        assert info["bytes_per_step"] == step_bytes(info["weight_bytes_per_step"], 1024, 40, 6)
        mem = llama_cpp.llama_get_memory(engine.llm.ctx)
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == 39
        for _ in range(2):
            steps = time_decode(engine, 40, 6, threads=1)
            assert len(steps) == 6 and min(steps) > 0
            assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == 45 and engine.llm.n_tokens == 46
    finally:
        engine.close()


def test_the_driver_refuses_to_write_over_a_result(tmp_path: Path):
    out = tmp_path / "earlier.json"
    out.write_text("{}")
    r = subprocess.run([sys.executable, "-m", "bench.bench_llamacpp_decode", "--no-source", "--random-mha", "2x64x4",
                        "--out", str(out), "--workdir", str(tmp_path / "w")], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "exists" in r.stderr.splitlines()[-1] and out.read_text() == "{}"
    assert not (tmp_path / "w").exists()  # refused before anything was written
