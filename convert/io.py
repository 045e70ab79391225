"""Streaming checkpoint IO: read one tensor at a time, write safetensors without buffering.

Reading: `open_source(folder)` opens single or sharded safetensors lazily (`safe_open`),
or `pytorch_model*.bin` with `torch.load(weights_only=True, mmap=True)`; every check on
the files (missing shard, a shard path escaping the folder, a truncated file, unsafe
pickles) becomes a one-line `GqakitError`.

Writing: `ShardWriter` knows every output tensor's name, dtype and shape in advance (the
conversion plan), so it writes each shard's safetensors header first and then streams
the tensors into it one by one. Peak memory is the largest tensor (or one layer's
attention block), never a whole shard.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from gqakit.core.errors import GqakitError
from gqakit.core.loading import read_st_header

ST_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    getattr(torch, "float8_e4m3fn", None): "F8_E4M3", getattr(torch, "float8_e5m2", None): "F8_E5M2",
}
_ST_DTYPES.pop(None, None)
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}


def _inside(folder: Path, rel: str) -> Path:
    p = (folder / rel).resolve()
    if folder.resolve() not in p.parents:
        raise GqakitError(f"shard path {rel!r} in the index escapes {folder}; refusing to read it")
    return p


def _read_index(folder: Path, index_name: str) -> dict[str, Path]:
    try:
        index = json.loads((folder / index_name).read_text())
        weight_map = index["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise GqakitError(f"{folder / index_name} is not a valid index: {e}") from None
    files: dict[str, Path] = {}
    for name, rel in weight_map.items():
        path = _inside(folder, rel)
        if not path.is_file():
            raise GqakitError(f"index {index_name} names shard {rel!r}, which is missing from {folder}")
        files[name] = path
    return files


class Source:
    """A read-only view of a checkpoint's tensors."""

    def names(self) -> list[str]:  # in an order that reads each file front to back
        raise NotImplementedError

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        raise NotImplementedError

    def get(self, name: str) -> Tensor:
        raise NotImplementedError

    def files(self) -> list[Path]:
        return []

    def raw(self, name: str) -> tuple[Path, int, int] | None:
        return None

    def close(self) -> None:
        pass


class SafetensorsSource(Source):
    def __init__(self, files_by_name: dict[str, Path]):
        from safetensors import SafetensorError, safe_open

        self._where = files_by_name
        self._handles: dict[Path, Any] = {}
        self._meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._range: dict[str, tuple[int, int]] = {}  # absolute byte range in its file
        self._order: list[str] = []
        for path in dict.fromkeys(files_by_name.values()):
            try:
                h = safe_open(str(path), framework="pt")
                header = _read_st_header(path)
            except (SafetensorError, OSError, ValueError) as e:
                raise GqakitError(f"cannot read {path.name}: truncated or corrupt safetensors file ({e})") from None
            self._handles[path] = h
            in_file = sorted((k for k in header if not k.startswith("__")), key=lambda k: header[k]["data_offsets"][0])
            for k in in_file:
                if self._where.get(k) == path:
                    dt = _FROM_ST.get(header[k]["dtype"])
                    if dt is None:
                        raise GqakitError(f"{path.name}: tensor {k} has unsupported dtype {header[k]['dtype']}")
                    self._meta[k] = (dt, tuple(header[k]["shape"]))
                    begin, end = header[k]["data_offsets"]
                    self._range[k] = (header["__data_start__"] + begin, end - begin)
                    self._order.append(k)
        missing = set(files_by_name) - set(self._meta)
        if missing:
            name = sorted(missing)[0]
            raise GqakitError(f"tensor {name} is listed in the index but not present in {files_by_name[name].name}")

    def names(self) -> list[str]:
        return list(self._order)

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return self._meta[name]

    def get(self, name: str) -> Tensor:
        from safetensors import SafetensorError

        try:
            return self._handles[self._where[name]].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise GqakitError(f"cannot read tensor {name} from {self._where[name].name}: {e}") from None

    def files(self) -> list[Path]:
        return list(self._handles)

    def raw(self, name: str) -> tuple[Path, int, int] | None:
        """(file, offset, length) of a tensor's bytes, for zero-decode pass-through copies."""
        return (self._where[name], *self._range[name])


_read_st_header = read_st_header  # lives in core.loading (no torch needed)


class DictSource(Source):
    """Tensors already in memory (a dequantized GGUF model, or a .bin state dict)."""

    def __init__(self, tensors: dict[str, Tensor], files: list[Path] | None = None):
        self._t = tensors
        self._files = files or []

    def names(self) -> list[str]:
        return list(self._t)

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        t = self._t[name]
        return t.dtype, tuple(t.shape)

    def get(self, name: str) -> Tensor:
        return self._t[name]

    def files(self) -> list[Path]:
        return self._files


def _load_bin(path: Path) -> dict[str, Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        raise GqakitError(f"{path.name} needs unsafe unpickling (weights_only=True refused it: "
                          f"{str(e).splitlines()[0][:160]}); convert it to safetensors first") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
        raise GqakitError(f"cannot read {path.name}: truncated or corrupt ({str(e).splitlines()[0][:160]})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise GqakitError(f"{path.name} is not a state dict of tensors")
    return sd


def open_source(folder: Path) -> Source:
    """Open the weights of an HF folder: safetensors (single/sharded) or .bin (single/sharded)."""
    if (folder / ST_INDEX).is_file():
        return SafetensorsSource(_read_index(folder, ST_INDEX))
    singles = sorted(folder.glob("*.safetensors"))
    if singles:
        if len(singles) > 1:
            raise GqakitError(f"{folder} holds several .safetensors files but no {ST_INDEX}")
        from safetensors import SafetensorError

        try:
            names = list(_read_st_header(singles[0]))
        except (OSError, ValueError) as e:
            raise GqakitError(f"cannot read {singles[0].name}: truncated or corrupt safetensors file ({e})") from None
        except SafetensorError as e:  # pragma: no cover
            raise GqakitError(str(e)) from None
        return SafetensorsSource({n: singles[0] for n in names if not n.startswith("__")})
    if (folder / BIN_INDEX).is_file():
        files = _read_index(folder, BIN_INDEX)
        tensors: dict[str, Tensor] = {}
        for path in dict.fromkeys(files.values()):
            tensors.update(_load_bin(path))
        return DictSource(tensors, list(dict.fromkeys(files.values())))
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if len(bins) == 1:
        return DictSource(_load_bin(bins[0]), bins)
    if bins:
        raise GqakitError(f"{folder} holds several .bin files but no {BIN_INDEX}")
    raise GqakitError(f"no weights in {folder}: expected model.safetensors, {ST_INDEX} or pytorch_model.bin")


# ----------------------------------------------------------------------------- writing

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
    """Writes planned tensors, in plan order, into safetensors shards (+ index)."""

    def __init__(self, folder: Path, plan: list[Planned], max_shard_bytes: int, metadata: dict[str, str] | None = None):
        self.folder = folder
        self.shards = plan_shards(plan, max_shard_bytes)
        n = len(self.shards)
        self.filenames = (["model.safetensors"] if n == 1 else
                          [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self.metadata = {"format": "pt", **(metadata or {})}
        self._queue: Iterator[tuple[int, Planned]] = ((i, p) for i, s in enumerate(self.shards) for p in s)
        self._file: BinaryIO | None = None
        self._shard = -1
        self.total_bytes = sum(p.nbytes for p in plan)

    def _open_shard(self, i: int) -> None:
        if self._file:
            self._file.close()
        header: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        for p in self.shards[i]:
            header[p.name] = {"dtype": _ST_DTYPES[p.dtype], "shape": list(p.shape),
                              "data_offsets": [offset, offset + p.nbytes]}
            offset += p.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment
        self._file = open(self.folder / self.filenames[i], "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._shard = i

    def _next(self, name: str) -> Planned:
        try:
            i, p = next(self._queue)
        except StopIteration:
            raise RuntimeError(f"tensor {name} was not planned") from None
        if p.name != name:
            raise RuntimeError(f"write order mismatch: got {name}, planned {p.name}")
        if i != self._shard:
            self._open_shard(i)
        return p

    def write(self, name: str, tensor: Tensor) -> None:
        p = self._next(name)
        if tuple(tensor.shape) != p.shape or tensor.dtype != p.dtype:
            raise RuntimeError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {p.shape} {p.dtype}")
        assert self._file is not None
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))

    def write_raw(self, name: str, path: Path, offset: int, length: int) -> None:
        """Copy a tensor's bytes unchanged from another safetensors file (kernel-side copy)."""
        p = self._next(name)
        if length != p.nbytes:
            raise RuntimeError(f"{name}: {length} bytes in the source, {p.nbytes} planned")
        assert self._file is not None
        self._file.flush()
        with open(path, "rb") as f:
            src_fd, dst_fd = f.fileno(), self._file.fileno()
            done = 0
            while done < length:
                try:
                    n = os.copy_file_range(src_fd, dst_fd, length - done, offset + done)
                except (AttributeError, OSError) as e:
                    if isinstance(e, OSError) and e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    f.seek(offset + done)
                    n = self._file.write(f.read(min(length - done, 64 << 20)))
                    self._file.flush()
                if n == 0:
                    raise OSError(errno.EIO, f"short read copying {name} from {path.name}")
                done += n

    def finish(self) -> None:
        if next(self._queue, None) is not None:
            raise RuntimeError("not every planned tensor was written")
        if self._file:
            self._file.close()
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {p.name: self.filenames[i] for i, s in enumerate(self.shards) for p in s}}
            (self.folder / ST_INDEX).write_text(json.dumps(index, indent=2) + "\n")
