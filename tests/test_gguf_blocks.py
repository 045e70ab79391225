"""GGUF input by row blocks: an unchanged tensor is dequantised and written a block at a time,
so memory is a block, not the tensor; the bytes are those of the whole-tensor path."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gqakit.convert import convert_checkpoint
from gqakit.convert import io as convert_io
from gqakit.convert.gguf_in import GGUFSource
from gqakit.convert.io import Planned, ShardWriter, copy_tensor
from gqakit.convert.source import open_model
from tests.test_convert_gguf import assert_bitwise_equal, folder_tensors, transformers_tensors, write_gguf

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

QTYPES = [QT.F16, QT.Q8_0, QT.Q4_1]


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".safetensors"}


@pytest.fixture
def pico_gguf(tiny_model, tmp_path):
    def make(qtype: QT, **extra) -> Path:
        model = AutoModelForCausalLM.from_pretrained(tiny_model("llama", num_key_value_heads=4, **extra)).eval()
        return write_gguf(model, tmp_path / f"m-{qtype.name}.gguf", "llama", qtype)
    return make


@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_blocks_of_one_row_write_the_bytes_of_the_whole_tensor_path(pico_gguf, tmp_path, monkeypatch, qtype):
    """With blocks forced down to one row (a quantised row is whole blocks of the format, never
    split), the folder is byte for byte the one written with whole tensors, and every tensor is
    transformers' own dequantisation."""
    path = pico_gguf(qtype)
    whole = convert_checkpoint(path, tmp_path / "whole", 4, method="mean")
    monkeypatch.setattr(convert_io, "BLOCK_BYTES", 1)
    made: list[tuple[str, int]] = []
    blocks = GGUFSource.blocks

    def spy(self, name, dtype, max_bytes):
        for b in blocks(self, name, dtype, max_bytes):
            made.append((name, b.shape[0]))
            yield b
    monkeypatch.setattr(GGUFSource, "blocks", spy)
    rows = convert_checkpoint(path, tmp_path / "rows", 4, method="mean")
    assert folder_bytes(rows) == folder_bytes(whole)
    assert_bitwise_equal(folder_tensors(rows), transformers_tensors(path))
    # the embedding really came one row at a time; a permuted q came one head at a time
    emb = [n for name, n in made if name == "model.embed_tokens.weight"]
    assert len(emb) == 64 and set(emb) == {1}
    q = [n for name, n in made if name == "model.layers.0.self_attn.q_proj.weight"]
    assert q and set(q) == {32 // 8}  # hidden 32, 8 query heads: 4 rows per head


@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_blocks_join_to_the_whole_tensor(pico_gguf, qtype):
    source = open_model(pico_gguf(qtype)).source
    assert isinstance(source, GGUFSource)
    for name in source.names():
        whole = source.get(name)
        for max_bytes in (1, 3 * 32 * 4 + 5, 1 << 30):  # one row; 3 rows and a bit; the whole tensor
            parts = list(source.blocks(name, torch.float32, max_bytes))
            assert torch.equal(torch.cat(parts).view(torch.uint8), whole.view(torch.uint8)), (name, max_bytes)
        if whole.dim() == 2:  # one row, or one head of a permuted q/k (4 rows), per block
            assert len(list(source.blocks(name, torch.float32, 1))) >= whole.shape[0] // 4
    bf = list(source.blocks("model.embed_tokens.weight", torch.bfloat16, 32 * 4))
    assert torch.equal(torch.cat(bf), source.get("model.embed_tokens.weight").to(torch.bfloat16))


def test_memory_is_a_block_not_the_tensor(pico_gguf, tmp_path, monkeypatch):
    """Passing a 512 KiB float32 embedding through allocates a few blocks' worth, not the tensor
    (numpy's buffers are traced by tracemalloc; the input is memory-mapped)."""
    path = pico_gguf(QT.Q8_0, vocab_size=4096)
    source = open_model(path).source
    name = "model.embed_tokens.weight"
    dtype, shape = source.meta(name)
    tensor_bytes = Planned(name, dtype, shape).nbytes
    assert tensor_bytes == 4096 * 32 * 4
    monkeypatch.setattr(convert_io, "BLOCK_BYTES", 8 << 10)
    writer = ShardWriter(tmp_path, [Planned(name, dtype, shape)], 1 << 30)
    next(source.blocks(name, dtype, 1))  # gguf-py's first call builds its tables
    tracemalloc.start()
    try:
        assert copy_tensor(source, writer, name, dtype) == tensor_bytes
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    writer.finish()
    assert peak < tensor_bytes // 8, peak
    # the check can fail: the whole-tensor path allocates the tensor
    tracemalloc.start()
    try:
        source.get(name)
        _, whole_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert whole_peak >= tensor_bytes


def test_blocks_that_do_not_fill_the_plan_are_refused(tmp_path):
    writer = ShardWriter(tmp_path, [Planned("w", torch.float32, (4, 3))], 1 << 30)
    with pytest.raises(RuntimeError, match="planned"):
        writer.write_blocks("w", [torch.zeros(3, 3)])
    with pytest.raises(RuntimeError, match="planned"):
        writer.write_blocks("w", [torch.zeros(2, 4)])
    with pytest.raises(RuntimeError, match="more than"):
        writer.write_blocks("w", [torch.zeros(3, 3), torch.zeros(3, 3)])
    assert writer.write_blocks("w", [torch.ones(3, 3), torch.full((1, 3), 2.0)]) == 48
    writer.finish()
    from safetensors.torch import load_file
    got = load_file(tmp_path / "model.safetensors")["w"]
    assert torch.equal(got, torch.tensor([[1.0] * 3] * 3 + [[2.0] * 3]))
    assert np.array_equal(got.numpy()[3], [2.0, 2.0, 2.0])


def test_the_metadata_is_parsed_once_at_a_time_and_not_kept(pico_gguf, monkeypatch):
    """transformers' parse of the metadata (the config) ends before gqakit's reader is made,
    and the opened source keeps the reader's tensors, not the reader (whose fields hold the
    vocabulary): the two parses' memory does not add up, and none of it stays."""
    import gc
    import weakref

    from gqakit.convert import gguf_in

    order: list[str] = []
    readers: list[weakref.ref] = []
    config, read = gguf_in.gguf_config, gguf_in.read_gguf

    def spy_config(path):
        order.append("config")
        return config(path)

    def spy_read(path):
        order.append("reader")
        got = read(path)
        readers.append(weakref.ref(got[0]))
        return got
    monkeypatch.setattr(gguf_in, "gguf_config", spy_config)
    monkeypatch.setattr(gguf_in, "read_gguf", spy_read)
    opened = open_model(pico_gguf(QT.Q8_0))
    gc.collect()
    assert order == ["config", "reader"]
    assert readers and readers[0]() is None
    assert torch.equal(opened.source.get("model.norm.weight"), opened.source.get("model.norm.weight"))
