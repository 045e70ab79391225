"""Unchanged tensors' bytes copied by the kernel on the writer's thread: the same files as
copies done in line, counted as written only once done, one thread at a time per file, the
copies not started dropped on close, and a failed copy is an error; shards preallocated
at their finished size (a full disk fails first), the same bytes as shards grown write by write;
every byte written handed to writeback as it is written, and every shard on disk before the
folder is published."""

from __future__ import annotations

import threading
from collections import Counter
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
    writer_started = threading.Event()
    copy = shards.copy_range

    def spy(*a):
        name = threading.current_thread().name
        threads.add(name)
        if name.startswith("gqakit-copy"):
            writer_started.set()
        elif shards.BACKGROUND_COPIES:  # the caller, quicker on a pico model, lets the writer thread start
            writer_started.wait(10)
        return copy(*a)
    monkeypatch.setattr(shards, "copy_range", spy)
    background = convert_checkpoint(src, tmp_path / "bg", 2, method="mean", progress=False, max_shard_size=40_000)
    # the writer thread's, and those into other shards that it had not started when the caller finished its own work
    assert any(t.startswith("gqakit-copy") for t in threads)
    assert all(t.startswith("gqakit-copy") or t == threading.main_thread().name for t in threads)
    threads.clear()
    monkeypatch.setattr(shards, "BACKGROUND_COPIES", False)
    inline = convert_checkpoint(src, tmp_path / "inline", 2, method="mean", progress=False, max_shard_size=40_000)
    assert threads == {threading.main_thread().name}
    assert len(folder_bytes(inline)) > 1 and folder_bytes(background) == folder_bytes(inline)


def _source_and_output(tmp_path: Path) -> tuple[torch.Tensor, Path]:
    """Twelve float32 values in `src.bin`, and an empty output folder."""
    data = torch.arange(12, dtype=torch.float32)
    (tmp_path / "src.bin").write_bytes(data.numpy().tobytes())
    out = tmp_path / "out"
    out.mkdir()
    return data, out


def test_a_copy_counts_as_written_once_done(tmp_path, monkeypatch):
    data, out = _source_and_output(tmp_path)
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


def test_the_caller_does_the_copies_into_other_shards_than_the_writer_threads(tmp_path, monkeypatch):
    data, out = _source_and_output(tmp_path)
    started, release = threading.Event(), threading.Event()
    by: dict[str, str] = {}
    lock, active, most = threading.Lock(), Counter(), Counter()  # copies running into each file, and at most
    copy = shards.copy_range

    def spy(*a):
        name, fd = a[-1], a[2]
        by[name] = threading.current_thread().name
        with lock:
            active[fd] += 1
            most[fd] = max(most[fd], active[fd])
        if name == "a":  # the writer thread stays in its first copy until the caller has done the other shard's
            started.set()
            release.wait(10)
        elif name == "c":  # the last the caller takes from the other shard (it goes from the end of the queue)
            release.set()
        copy(*a)
        with lock:
            active[fd] -= 1
    monkeypatch.setattr(shards, "copy_range", spy)
    # shards of two tensors each: a, b in the first file, c, d in the second
    writer = ShardWriter(out, [Planned(n, torch.float32, (12,)) for n in "abcd"], 96)
    for n in "abcd":
        writer.write_raw(n, tmp_path / "src.bin", 0, 48)
    assert started.wait(10)
    writer.finish()
    assert by["a"].startswith("gqakit-copy") and by["c"] == by["d"] == threading.main_thread().name
    assert set(most.values()) == {1}  # b waited for a: two threads never copy into one file at once
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        got = load_file(out / f)
        assert len(got) == 2 and all(torch.equal(t, data) for t in got.values())


def test_closing_drops_the_copies_not_started(tmp_path, monkeypatch):
    data, out = _source_and_output(tmp_path)
    started, release = threading.Event(), threading.Event()
    done: list[str] = []
    copy = shards.copy_range

    def slow(*a):
        started.set()
        release.wait(10)
        copy(*a)
        done.append(a[-1])
    monkeypatch.setattr(shards, "copy_range", slow)
    writer = ShardWriter(out, [Planned(n, torch.float32, (12,)) for n in "abc"], 1 << 30)
    for n in "abc":
        writer.write_raw(n, tmp_path / "src.bin", 0, 48)
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    writer.close()  # waits for the copy running (a), drops b and c
    assert done == ["a"]
    assert not any(t.name.startswith("gqakit-copy") for t in threading.enumerate())


def test_a_failed_copy_is_raised(tmp_path):
    (tmp_path / "short.bin").write_bytes(b"\0" * 8)  # a source cut short: 8 of the 16 bytes
    out = tmp_path / "out"
    out.mkdir()
    writer = ShardWriter(out, [Planned("a", torch.float32, (4,))], 1 << 30)
    writer.write_raw("a", tmp_path / "short.bin", 0, 16)
    with pytest.raises(OSError, match="short read copying a"):
        writer.finish()
    writer.close()


def test_preallocated_shards_hold_the_bytes_of_shards_grown_write_by_write(tiny_model, tmp_path, monkeypatch):
    src = tiny_model("llama", num_key_value_heads=8, dtype=torch.bfloat16)
    calls: list[int] = []
    real = shards.preallocate

    def spy(fd, size, path):
        calls.append(size)
        return real(fd, size, path)
    monkeypatch.setattr(shards, "preallocate", spy)
    allocated = convert_checkpoint(src, tmp_path / "alloc", 2, method="mean", progress=False, max_shard_size=40_000)
    files = folder_bytes(allocated)
    assert sorted(calls) == sorted(len(b) for b in files.values())  # each shard at its finished size
    monkeypatch.setattr(shards, "preallocate", lambda fd, size, path: None)
    grown = convert_checkpoint(src, tmp_path / "grown", 2, method="mean", progress=False, max_shard_size=40_000)
    assert len(files) > 1 and files == folder_bytes(grown)


def _failing_fallocate(err: int):
    import ctypes

    def fallocate(fd, mode, offset, length):
        ctypes.set_errno(err)
        return -1
    return lambda: fallocate


def test_a_full_disk_fails_at_preallocation_and_leaves_nothing(tiny_model, tmp_path, monkeypatch, capsys):
    import errno

    from cli_helpers import assert_one_line_error, run_cli

    src = tiny_model("llama", num_key_value_heads=8)
    monkeypatch.setattr(shards, "_fallocate", _failing_fallocate(errno.ENOSPC))
    code, _, err = run_cli(["convert", src, tmp_path / "o", "-g", 2, "--method", "mean", "-q"], capsys)
    assert_one_line_error(code, err, "no space left")
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # neither OUT nor a temporary folder


def test_a_file_system_without_fallocate_gets_the_shards_written_as_they_come(tiny_model, tmp_path, monkeypatch):
    import errno

    src = tiny_model("llama", num_key_value_heads=8, dtype=torch.bfloat16)
    monkeypatch.setattr(shards, "_fallocate", _failing_fallocate(errno.EOPNOTSUPP))
    out = convert_checkpoint(src, tmp_path / "o", 2, method="mean", progress=False)
    monkeypatch.setattr(shards, "preallocate", lambda fd, size, path: None)
    assert folder_bytes(out) == folder_bytes(convert_checkpoint(src, tmp_path / "g", 2, method="mean", progress=False))


def _data_offsets(path: Path) -> dict[str, int]:
    """Each tensor's absolute byte offset in a safetensors file."""
    import json
    import struct

    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: 8 + n + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def test_the_header_padding_puts_the_most_copied_bytes_at_their_source_place_in_a_page(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32), "big": torch.arange(3000, dtype=torch.float32),
               "c": torch.arange(5, dtype=torch.float32)}
    plan = [Planned(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    # "big" sits at byte 4096 * 3 + 24 of its source file, "a" at 8: the larger wins
    writer = ShardWriter(tmp_path, plan, 10**9, origins={"a": 8, "big": 4096 * 3 + 24})
    for k, t in tensors.items():
        writer.write(k, t)
    writer.finish()
    at = _data_offsets(tmp_path / "model.safetensors")
    assert at["big"] % shards.PAGE == 24 and at["a"] % 8 == 0
    assert all(torch.equal(load_file(tmp_path / "model.safetensors")[k], t) for k, t in tensors.items())
    # without origins, the header is the plain JSON padded to 8 bytes
    plain = tmp_path / "plain"
    plain.mkdir()
    writer = ShardWriter(plain, plan, 10**9)
    for k, t in tensors.items():
        writer.write(k, t)
    writer.finish()
    unpadded = _data_offsets(plain / "model.safetensors")["a"]
    assert unpadded < at["a"] and unpadded % 8 == 0


def test_a_converted_folder_copies_unchanged_tensors_to_their_place_in_a_page(tiny_model, tmp_path):
    src = tiny_model("llama", num_key_value_heads=8, dtype=torch.bfloat16)
    out = convert_checkpoint(src, tmp_path / "out", 2, method="mean", progress=False)
    before = _data_offsets(src / "model.safetensors")
    after = _data_offsets(out / "model.safetensors")
    sizes = {k: v.numel() * v.element_size() for k, v in load_file(out / "model.safetensors").items()}
    largest = max((k for k in after if "k_proj" not in k and "v_proj" not in k), key=sizes.__getitem__)
    assert (after[largest] - before[largest]) % shards.PAGE == 0
    assert "k_proj" in " ".join(after) and load_file(out / "model.safetensors").keys() == after.keys()


def test_every_byte_written_goes_to_writeback_at_once_and_every_shard_is_synced_before_publishing(
        tiny_model, tmp_path, monkeypatch):
    src = tiny_model("llama", num_key_value_heads=8, dtype=torch.bfloat16)
    whole = convert_checkpoint(src, tmp_path / "whole", 2, method="mean", progress=False, max_shard_size=40_000)
    ranges: dict[str, list[tuple[int, int]]] = {}
    synced: list[Path] = []
    behind, fsync = shards.write_behind, shards.os.fsync

    def where(fd: int) -> Path:
        return Path(shards.os.readlink(f"/proc/self/fd/{fd}"))

    def spy_behind(fd: int, offset: int, length: int) -> None:
        ranges.setdefault(where(fd).name, []).append((offset, offset + length))
        behind(fd, offset, length)

    def spy_fsync(fd: int) -> None:
        path = where(fd)
        assert not (tmp_path / "chunked").exists()  # before the folder is published
        synced.append(path)
        fsync(fd)
    monkeypatch.setattr(shards, "write_behind", spy_behind)
    monkeypatch.setattr(shards.os, "fsync", spy_fsync)
    monkeypatch.setattr(shards, "COPY_CHUNK", 4096)  # kernel copies in many chunks, each handed on as done
    chunked = convert_checkpoint(src, tmp_path / "chunked", 2, method="mean", progress=False, max_shard_size=40_000)
    files = folder_bytes(chunked)
    assert len(files) > 1 and files == folder_bytes(whole)
    assert sorted(p.name for p in synced) == sorted(files)
    for name, data in files.items():
        start = 8 + int.from_bytes(data[:8], "little")  # the tensors' bytes, after the header
        covered = sorted(ranges[name])
        assert covered[0][0] <= start and covered[-1][1] == len(data)
        assert all(a[1] >= b[0] for a, b in zip(covered, covered[1:]))  # no gap
    assert any(b - a == 4096 for r in ranges.values() for a, b in r)  # the copies' chunks


@pytest.mark.parametrize("err, ok", [("EIO", False), ("ENOSPC", False), ("EINVAL", True)])
def test_a_disk_error_at_the_final_sync_publishes_nothing(tiny_model, tmp_path, monkeypatch, capsys, err, ok):
    """The shards' fsync reports a failed write (EIO, or a full disk where space is reserved only
    then): nothing at OUT. A file system that cannot sync a file (EINVAL) is no error."""
    import errno

    from cli_helpers import assert_one_line_error, run_cli

    src = tiny_model("llama", num_key_value_heads=8)
    fsync = shards.os.fsync

    def failing(fd: int) -> None:
        raise OSError(getattr(errno, err), shards.os.strerror(getattr(errno, err)))
    monkeypatch.setattr(shards.os, "fsync", failing)
    code, _, stderr = run_cli(["convert", src, tmp_path / "o", "-g", 2, "--method", "mean", "-q"], capsys)
    monkeypatch.setattr(shards.os, "fsync", fsync)
    if ok:
        assert code == 0 and (tmp_path / "o" / "model.safetensors").is_file()
        return
    assert_one_line_error(code, stderr, "no space left" if err == "ENOSPC" else "could not write")
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # neither OUT nor a temporary folder
