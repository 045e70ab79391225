"""Unchanged tensors' bytes copied by the kernel on the writer's thread: the same files as
copies done in line, counted as written only once done, and a failed copy is an error."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gqakit.convert import convert_checkpoint
from gqakit.convert import shards
from gqakit.convert.shards import Planned, ShardWriter


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".safetensors"}


def test_copies_on_the_writer_thread_write_the_bytes_of_copies_in_line(tiny_model, tmp_path, monkeypatch):
    src = tiny_model("llama", num_key_value_heads=8, dtype=torch.bfloat16)
    threads: set[str] = set()
    copy = shards.copy_range

    def spy(*a):
        threads.add(threading.current_thread().name)
        return copy(*a)
    monkeypatch.setattr(shards, "copy_range", spy)
    background = convert_checkpoint(src, tmp_path / "bg", 2, method="mean", progress=False, max_shard_size=40_000)
    # the writer thread's, and the ones it had not started when the caller finished its own work
    assert any(t.startswith("gqakit-copy") for t in threads)
    assert all(t.startswith("gqakit-copy") or t == threading.main_thread().name for t in threads)
    threads.clear()
    monkeypatch.setattr(shards, "BACKGROUND_COPIES", False)
    inline = convert_checkpoint(src, tmp_path / "inline", 2, method="mean", progress=False, max_shard_size=40_000)
    assert threads == {threading.main_thread().name}
    assert len(folder_bytes(inline)) > 1 and folder_bytes(background) == folder_bytes(inline)


def test_a_copy_counts_as_written_once_done(tmp_path, monkeypatch):
    data = torch.arange(12, dtype=torch.float32)
    (tmp_path / "src.bin").write_bytes(data.numpy().tobytes())
    out = tmp_path / "out"
    out.mkdir()
    release = threading.Event()
    copy = shards.copy_range

    def slow(*a):
        release.wait(10)
        return copy(*a)
    monkeypatch.setattr(shards, "copy_range", slow)
    writer = ShardWriter(out, [Planned("a", torch.float32, (12,)), Planned("b", torch.float32, (2,))], 1 << 30)
    writer.write_raw("a", tmp_path / "src.bin", 0, 48)
    with pytest.raises(RuntimeError, match="written twice"):
        writer.write_raw("a", tmp_path / "src.bin", 0, 48)
    writer.write("b", torch.ones(2))
    assert "a" not in writer._written  # in flight
    release.set()
    assert writer.written == ["a", "b"]  # waits for the copy
    writer.finish()
    assert torch.equal(load_file(out / "model.safetensors")["a"], data)


def test_the_caller_does_the_copies_the_writer_thread_has_not_started(tmp_path, monkeypatch):
    data = torch.arange(12, dtype=torch.float32)
    (tmp_path / "src.bin").write_bytes(data.numpy().tobytes())
    out = tmp_path / "out"
    out.mkdir()
    started, release = threading.Event(), threading.Event()
    by: dict[str, str] = {}
    copy = shards.copy_range

    def spy(*a):
        name = a[-1]
        by[name] = threading.current_thread().name
        if name == "a":  # the writer thread stays in its first copy until the caller has taken the others
            started.set()
            release.wait(10)
        elif name == "b":  # the last the caller takes (it goes from the end of the queue)
            release.set()
        return copy(*a)
    monkeypatch.setattr(shards, "copy_range", spy)
    writer = ShardWriter(out, [Planned(n, torch.float32, (12,)) for n in "abc"], 1 << 30)
    for n in "abc":
        writer.write_raw(n, tmp_path / "src.bin", 0, 48)
    assert started.wait(10)
    writer.finish()
    assert by["a"].startswith("gqakit-copy") and by["b"] == by["c"] == threading.main_thread().name
    got = load_file(out / "model.safetensors")
    assert all(torch.equal(got[n], data) for n in "abc")


def test_a_failed_copy_is_raised(tmp_path):
    (tmp_path / "short.bin").write_bytes(b"\0" * 8)  # a source cut short: 8 of the 16 bytes
    out = tmp_path / "out"
    out.mkdir()
    writer = ShardWriter(out, [Planned("a", torch.float32, (4,))], 1 << 30)
    writer.write_raw("a", tmp_path / "short.bin", 0, 16)
    with pytest.raises(OSError, match="short read copying a"):
        writer.finish()
    writer.close()
