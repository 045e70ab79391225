"""Unchanged tensors passed through a folder conversion: raw byte copies when the dtype is
kept, row blocks when it changes; either way the bytes of the plain whole-tensor path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gqakit.convert import convert_checkpoint
from gqakit.convert import io as convert_io
from gqakit.convert.io import DictSource, ShardWriter, open_source


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".safetensors"}


def plain_copy_tensor(source, writer, name, dtype):
    """The whole-tensor path: read the tensor, cast it, write it."""
    t = source.get(name).to(dtype)
    writer.write(name, t)
    return t.numel() * t.dtype.itemsize


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_fast_paths_write_the_bytes_of_the_plain_path(tiny_model, tmp_path, monkeypatch, dtype):
    """Kernel-side byte copies (kept dtype) and one-row blocks (a cast) give the same files as
    reading, casting and writing each whole tensor."""
    src = tiny_model("llama", num_key_value_heads=8, dtype=torch.float16)
    fast = convert_checkpoint(src, tmp_path / "fast", 2, method="mean", dtype=dtype, progress=False,
                              max_shard_size=40_000)
    monkeypatch.setattr(convert_io, "BLOCK_BYTES", 1)
    rows = convert_checkpoint(src, tmp_path / "rows", 2, method="mean", dtype=dtype, progress=False,
                              max_shard_size=40_000)
    from gqakit.convert import pipeline
    monkeypatch.setattr(pipeline, "copy_tensor", plain_copy_tensor)
    plain = convert_checkpoint(src, tmp_path / "plain", 2, method="mean", dtype=dtype, progress=False,
                               max_shard_size=40_000)
    assert len(folder_bytes(plain)) > 1  # sharded
    assert folder_bytes(fast) == folder_bytes(plain)
    assert folder_bytes(rows) == folder_bytes(plain)


def test_safetensors_blocks_join_to_the_cast_tensor(tiny_model):
    source = open_source(tiny_model("llama", dtype=torch.bfloat16))
    for name in source.names():
        want = source.get(name).to(torch.float32)
        for max_bytes in (1, 200, 1 << 30):
            parts = list(source.blocks(name, torch.float32, max_bytes))
            assert torch.equal(torch.cat(parts) if want.dim() else parts[0], want), (name, max_bytes)
        if want.dim() == 2:
            assert len(list(source.blocks(name, torch.float32, 1))) == want.shape[0]


def test_dict_source_blocks(tmp_path):
    t = torch.randn(10, 3, dtype=torch.float64)
    source = DictSource({"w": t})
    parts = list(source.blocks("w", torch.float16, 3 * 8 * 4))
    assert [p.shape[0] for p in parts] == [4, 4, 2]
    assert torch.equal(torch.cat(parts), t.to(torch.float16))
    writer = ShardWriter(tmp_path, [convert_io.Planned("w", torch.float16, (10, 3))], 1 << 30)
    assert convert_io.copy_tensor(source, writer, "w", torch.float16) == 60
    writer.finish()
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], t.to(torch.float16))


def test_the_plain_path_is_not_the_fast_one(tiny_model, tmp_path, monkeypatch):
    """The comparison above can fail: kept-dtype tensors go through the kernel-side copy, and
    a cast through row blocks, never through a whole-tensor read."""
    src = tiny_model("llama", num_key_value_heads=8, dtype=torch.float16)
    calls = {"raw": 0, "get": 0}
    raw, get = ShardWriter.write_raw, convert_io.SafetensorsSource.get

    def count_raw(self, *a):
        calls["raw"] += 1
        return raw(self, *a)

    def count_get(self, name):
        calls["get"] += 1
        return get(self, name)
    monkeypatch.setattr(ShardWriter, "write_raw", count_raw)
    monkeypatch.setattr(convert_io.SafetensorsSource, "get", count_get)
    convert_checkpoint(src, tmp_path / "a", 2, method="mean")
    layers = 2
    assert calls == {"raw": len(open_source(src).names()) - 2 * layers, "get": 2 * layers}  # k and v read whole
    calls.update(raw=0, get=0)
    convert_checkpoint(src, tmp_path / "b", 2, method="mean", dtype="float32")
    norms = sum(len(open_source(src).meta(n)[1]) == 1 for n in open_source(src).names())
    assert calls == {"raw": 0, "get": 2 * layers + norms}  # a 1-D tensor is one block: read whole
