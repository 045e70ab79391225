"""Writing safetensors shards whose layout is planned up front, tensor by tensor.

`ShardWriter` knows every output tensor's name, dtype and shape in advance (the conversion
plan), so each shard's disk space is allocated at once (`preallocate`), its header written
first, and every tensor then goes straight to its byte range: `write` (a tensor in memory), `write_blocks` (a tensor's row blocks as they
come: memory is a block), `write_raw` (an unchanged tensor's bytes, copied file to file by
the kernel with `copy_file_range`, no byte through Python). Each shard's header is padded so
that most of the copied bytes land at the same offset within a page as in their source file
(`origins`): the kernel copies page-aligned ranges for less CPU than shifted ones (on ext4, 8%
less on the IO benchmark's copies). The kernel-side copies run on a
writer thread, in the order given, while the caller reads and converts the next tensors;
`written`, `flush` and `finish` wait for them, and a copy's error is raised by the next call.
While it waits, the calling thread takes the copies not yet started into the other shards
(from the end of the queue): two threads never copy into one file at once, since the
kernel writes a file under one lock (the second would spin on it, and copy nothing).
Peak memory is what the caller holds, never a shard.
Every range written is handed to the kernel's writeback at once (`write_behind`), so the disk
writes run alongside the copies instead of after them: a `sync` after the conversion then
has little left to do (`docs/benchmarks.md`, Conversion IO).
`finish` returns once every shard's bytes are on disk (`fsync`), as the GGUF writer does, so
the folder published after it never holds weights still only in memory.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import struct
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from gqakit.core.errors import GqakitError

ST_INDEX = "model.safetensors.index.json"
PAGE = 4096  # the page size the kernel's copies go by
BACKGROUND_COPIES = True  # kernel-side copies on a writer thread (False: each copy done before write_raw returns)
COPY_CHUNK = 64 << 20  # a kernel-side copy goes this many bytes at a time, each handed to writeback as it is done

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    getattr(torch, "float8_e4m3fn", None): "F8_E4M3", getattr(torch, "float8_e5m2", None): "F8_E5M2",
}
ST_DTYPES.pop(None, None)
FROM_ST = {v: k for k, v in ST_DTYPES.items()}

@dataclass
class Planned:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(plan: list[Planned], max_shard_bytes: int) -> list[list[Planned]]:
    shards: list[list[Planned]] = [[]]
    size = 0
    for p in plan:
        if shards[-1] and size + p.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


class ShardWriter:
    """Writes planned tensors into safetensors shards (+ index), in any order.

    Every tensor's shard and byte offset follow from the plan, so each shard's header is
    written when the shard is first touched and every tensor goes straight to its place
    (`pwrite`, or a kernel-side copy for unchanged bytes). The pass-through tensors can
    thus be written in file order and the converted attention layer by layer.
    Not thread-safe: one caller thread (the copies run on the writer's own thread).
    """

    def __init__(self, folder: Path, plan: list[Planned], max_shard_bytes: int, metadata: dict[str, str] | None = None,
                 written: Iterable[str] = (), origins: Mapping[str, int] | None = None):
        """`written`: tensors an interrupted run already wrote into `folder` (resuming it);
        `origins`: the byte offset in its source file of each tensor that will be copied
        unchanged (`write_raw`), for the headers' padding."""
        self.folder = folder
        self.shards = plan_shards(plan, max_shard_bytes)
        n = len(self.shards)
        self.filenames = (["model.safetensors"] if n == 1 else
                          [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self.metadata = {"format": "pt", **(metadata or {})}
        self._headers = [self._header(s, origins or {}) for s in self.shards]
        self._slot: dict[str, tuple[int, int, Planned]] = {}  # name -> (shard, absolute offset, plan)
        self._sizes: list[int] = []  # each shard file's size
        for i, shard in enumerate(self.shards):
            offset = len(self._headers[i])
            for p in shard:
                self._slot[p.name] = (i, offset, p)
                offset += p.nbytes
            self._sizes.append(offset)
        self._files: dict[int, BinaryIO] = {}
        self._written: set[str] = set(written)
        self._resuming = bool(self._written)
        self._at = (0, 0)  # (shard, offset) of the tensor being written
        self._copies = CopyQueue() if BACKGROUND_COPIES else None  # None: each copy done before write_raw returns
        self.total_bytes = sum(p.nbytes for p in plan)

    def _header(self, shard: list[Planned], origins: Mapping[str, int]) -> bytes:
        """The shard's header: its JSON, padded with spaces (as safetensors allows) to 8 bytes,
        and further so that the data starts where the most copied bytes sit at their source
        offset's place within a page."""
        header: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        copied: dict[int, int] = {}  # data start (mod PAGE) that aligns a copy -> its bytes
        for p in shard:
            header[p.name] = {"dtype": ST_DTYPES[p.dtype], "shape": list(p.shape),
                              "data_offsets": [offset, offset + p.nbytes]}
            if p.name in origins and origins[p.name] % 8 == 0:
                start = (origins[p.name] - offset) % PAGE
                copied[start] = copied.get(start, 0) + p.nbytes
            offset += p.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        pad = -len(raw) % 8  # safetensors pads the header to 8-byte alignment
        if copied:
            start = max(copied, key=lambda k: copied[k])
            pad = (start - 8 - len(raw)) % PAGE
        return struct.pack("<Q", len(raw) + pad) + raw + b" " * pad

    def _file(self, i: int) -> BinaryIO:
        if i not in self._files:
            path = self.folder / self.filenames[i]
            if self._resuming and path.is_file():
                f = open(path, "r+b")  # keep what the interrupted run wrote
                if f.read(len(self._headers[i])) != self._headers[i]:
                    f.close()
                    raise GqakitError(f"{path} does not belong to this conversion; delete {self.folder} and re-run")
            else:
                f = open(path, "wb")
                preallocate(f.fileno(), self._sizes[i], path)
                f.write(self._headers[i])
                f.flush()
            self._files[i] = f
        return self._files[i]

    @property
    def written(self) -> list[str]:
        """The tensors in the shards (every copy in flight is waited for)."""
        self.flush()
        return sorted(self._written)

    def _next(self, name: str) -> Planned:
        """The plan entry of the next tensor written; sets where it goes."""
        if name not in self._slot:
            raise RuntimeError(f"tensor {name} was not planned")
        if name in self._written or (self._copies is not None and name in self._copies):
            raise RuntimeError(f"tensor {name} written twice")
        i, offset, p = self._slot[name]
        self._at = (i, offset)
        return p

    def write(self, name: str, tensor: Tensor) -> None:
        p = self._next(name)
        if tuple(tensor.shape) != p.shape or tensor.dtype != p.dtype:
            raise RuntimeError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {p.shape} {p.dtype}")
        i, offset = self._at
        fd = self._file(i).fileno()
        data = memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
        write_behind(fd, offset, done)
        self._written.add(name)

    def write_blocks(self, name: str, blocks: Iterable[Tensor]) -> int:
        """Write tensor NAME from consecutive blocks of its first axis (`Source.blocks`), each
        to its place as it comes: memory is one block. Returns the bytes written."""
        p = self._next(name)
        i, offset = self._at
        fd = self._file(i).fileno()
        done = 0
        for block in blocks:
            shape = tuple(block.shape)
            if block.dtype != p.dtype or len(shape) != len(p.shape) or shape[1:] != p.shape[1:]:
                raise RuntimeError(f"{name}: got a block of {shape} {block.dtype}, planned {p.shape} {p.dtype}")
            data = memoryview(block.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            if done + len(data) > p.nbytes:
                raise RuntimeError(f"{name}: the blocks hold more than the planned {p.shape}")
            n = 0
            while n < len(data):
                n += os.pwrite(fd, data[n:], offset + done + n)
            write_behind(fd, offset + done, n)
            done += len(data)
            del data, block  # before the next block is made
        if done != p.nbytes:
            raise RuntimeError(f"{name}: the blocks hold {done} bytes, planned {p.nbytes} ({p.shape} {p.dtype})")
        self._written.add(name)
        return done

    def write_raw(self, name: str, path: Path, offset: int, length: int) -> None:
        """Copy a tensor's bytes unchanged from another file (kernel-side copy), on the writer
        thread: it is counted as written once the copy is done."""
        p = self._next(name)
        if length != p.nbytes:
            raise RuntimeError(f"{name}: {length} bytes in the source, {p.nbytes} planned")
        i, dst_off = self._at
        args = (path, offset, self._file(i).fileno(), dst_off, length, name)
        if self._copies is None:
            copy_range(*args)
            self._written.add(name)
            return
        self._reap()  # the copies done so far (raising one that failed); this one's error comes with the next call
        self._copies.submit(name, i, args)

    @property
    def copying(self) -> bool:
        """Whether kernel-side copies are still queued or running on the writer thread (a
        copy that failed is raised here)."""
        self._reap()
        return self._copies is not None and len(self._copies) > 0

    def _reap(self, block: bool = False) -> None:
        """Count the finished copies as written (all of them, with BLOCK: the calling thread
        first does the copies into other shards than the writer thread's, then waits); raise
        the first copy that failed."""
        if self._copies is None:
            return
        if block:
            self._copies.drain()
        failed: BaseException | None = None
        for name, error in self._copies.finished():
            if error is None:
                self._written.add(name)
            elif failed is None:
                failed = error
        if failed is not None:
            raise failed

    def flush(self) -> None:
        """Finish every copy in flight (some of those not started yet on the calling thread)."""
        self._reap(block=True)

    def close(self) -> None:
        """Drop the copies not started yet and wait for the running ones (errors are dropped:
        this runs on the way out of a failure too), then close the shards."""
        if self._copies is not None:
            self._copies.close()
        for f in self._files.values():
            f.close()
        self._files.clear()

    def finish(self) -> None:
        self.flush()
        missing = [n for n in self._slot if n not in self._written]
        if missing:
            raise RuntimeError(f"not every planned tensor was written (first missing: {missing[0]})")
        for i in range(len(self.shards)):
            self._file(i)  # a shard of zero-byte tensors still needs its header
        for i, f in self._files.items():
            f.flush()
            sync_file(f.fileno(), self.folder / self.filenames[i])  # before the folder is published
        self.close()
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {p.name: self.filenames[i] for i, s in enumerate(self.shards) for p in s}}
            (self.folder / ST_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def preallocate(fd: int, size: int, path: Path) -> None:
    """Allocate SIZE bytes of disk to the new file FD at once (Linux `fallocate`), so that the
    writes and kernel-side copies fill blocks already allocated instead of reserving them
    page by page (on ext4, about a fifth less CPU per byte copied), and a full disk fails here,
    before any tensor is written. The file reads as zeros until written, and its size is
    SIZE, which is the finished shard's. Where the platform or the file system has no
    `fallocate`, nothing (never a fallback that writes zeros)."""
    fallocate = _fallocate()
    if fallocate is None or size <= 0:
        return
    if fallocate(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise OSError(err, os.strerror(err), str(path))


def sync_file(fd: int, path: Path) -> None:
    """FD's data on disk (`fsync`; little is left to write after `write_behind`). An error the
    disk gives (EIO, or ENOSPC where space is reserved only now) is raised, so the folder is
    never published; a file system that cannot sync a file (EINVAL, EOPNOTSUPP) is left as is."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            raise OSError(e.errno, e.strerror, str(path)) from None


def write_behind(fd: int, offset: int, length: int) -> None:
    """Start the disk writes of LENGTH bytes of FD from OFFSET now, without waiting for them
    (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`): the page cache otherwise holds them
    until the dirty threshold (a tenth of memory) or a `sync`. Advisory: nothing where the
    platform has no such call, and its errors are the next write's or `fsync`'s to report."""
    fn = _libc("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint))
    if fn is not None and length > 0:
        fn(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE


def _fallocate() -> Any:
    """libc's `fallocate(fd, mode, offset, len)`, or None where there is none."""
    return _libc("fallocate", (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64))


@functools.cache
def _libc(name: str, argtypes: tuple[Any, ...]) -> Any:
    """Linux libc's function NAME taking ARGTYPES and returning an int, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


def copy_range(path: Path, offset: int, dst_fd: int, dst_offset: int, length: int, name: str) -> None:
    """LENGTH bytes of PATH from OFFSET to DST_FD at DST_OFFSET, copied by the kernel
    (`copy_file_range`; a plain read and write where the file systems cannot)."""
    with open(path, "rb") as f:
        src_fd = f.fileno()
        done = 0
        while done < length:
            step = min(length - done, COPY_CHUNK)
            try:
                n = os.copy_file_range(src_fd, dst_fd, step, offset + done, dst_offset + done)
            except (AttributeError, OSError) as e:
                if isinstance(e, OSError) and e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                f.seek(offset + done)
                n = os.pwrite(dst_fd, f.read(step), dst_offset + done)
            if n == 0:
                raise OSError(errno.EIO, f"short read copying {name} from {path.name}")
            write_behind(dst_fd, dst_offset + done, n)
            done += n


class CopyQueue:
    """Kernel-side copies (`copy_range` arguments), each into one of the output shards, run
    on a writer thread in the order submitted. `drain` has the calling thread help: it takes
    the last queued copy into a shard no thread is copying into, and otherwise waits. One
    thread per destination file: buffered writes to a file hold its inode lock, so a second
    thread writing the same file only spins."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queued: dict[str, tuple[int, tuple[Any, ...]]] = {}  # name -> (shard, arguments), in order
        self._running: dict[str, int] = {}  # name -> shard, being copied now
        self._done: list[tuple[str, BaseException | None]] = []  # finished since the last `finished`
        self._thread: threading.Thread | None = None
        self._closing = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._queued) + len(self._running)

    def __contains__(self, name: str) -> bool:
        with self._cond:
            return name in self._queued or name in self._running or any(n == name for n, _ in self._done)

    def submit(self, name: str, shard: int, args: tuple[Any, ...]) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("the copies are closed")
            self._queued[name] = (shard, args)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="gqakit-copy", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def finished(self) -> list[tuple[str, BaseException | None]]:
        """The copies finished since the last call: (name, its error or None), in the order done."""
        with self._cond:
            done, self._done = self._done, []
            return done

    def _take(self, last: bool) -> tuple[str, tuple[Any, ...]] | None:
        """The first (LAST: the last) queued copy into a shard that no thread copies into,
        marked as running; None if there is none. Called with the lock held."""
        busy = set(self._running.values())
        for name in (reversed(self._queued) if last else self._queued):
            shard, args = self._queued[name]
            if shard not in busy:
                del self._queued[name]
                self._running[name] = shard
                return name, args
        return None

    def _run(self, name: str, args: tuple[Any, ...]) -> None:
        error: BaseException | None = None
        try:
            copy_range(*args)
        except BaseException as e:  # raised to the caller by the writer's next call
            error = e
            if not isinstance(e, Exception):
                raise  # Ctrl-C in a copy on the calling thread stops it now
        finally:
            with self._cond:
                del self._running[name]
                self._done.append((name, error))
                self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                job = None
                while not self._closing and (job := self._take(last=False)) is None:
                    self._cond.wait()
                if job is None:
                    return
            self._run(*job)

    def drain(self) -> None:
        """Return once every submitted copy is done, doing some on the calling thread."""
        while True:
            with self._cond:
                job = self._take(last=True)
                if job is None:
                    if not self._queued and not self._running:
                        return
                    self._cond.wait()
                    continue
            self._run(*job)

    def close(self) -> None:
        """Drop the copies not started yet, wait for the running ones and stop the thread."""
        with self._cond:
            self._closing = True
            self._queued.clear()
            self._cond.notify_all()
            while self._running:
                self._cond.wait()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
