"""Streaming model IO: read one tensor at a time, write safetensors without buffering.

Reading: `open_source(folder)` opens single or sharded safetensors lazily and reads each
tensor with `pread` (a file cut while it is read is then a short read, not a SIGBUS), or
`pytorch_model*.bin` with `torch.load(weights_only=True, mmap=True)`; every check on the
files (missing shard, a shard path escaping the folder, a truncated file, unsafe pickles;
`core/modelfiles.py`) becomes a one-line `GqakitError`.

Writing: `shards.ShardWriter` (also importable from here) writes each shard's header first
and streams the tensors into it. `copy_tensor` passes an unchanged tensor through: its bytes
copied file to file by the kernel when the dtype is kept, else read, cast and written in row
blocks of `BLOCK_BYTES` (`Source.blocks`), so that memory is a block, not the tensor. Peak
memory is one layer's attention block or one row block, never a whole shard.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gqakit.convert.shards import FROM_ST, ST_INDEX, Planned, ShardWriter, plan_shards
from gqakit.core.errors import GqakitError
from gqakit.core.modelfiles import index_map, load_bin, read_st_header

__all__ = ["BLOCK_BYTES", "DictSource", "Opened", "Planned", "SafetensorsSource", "ShardWriter", "Source",
           "copy_tensor", "open_source", "plan_shards", "row_step"]

BIN_INDEX = "pytorch_model.bin.index.json"


BLOCK_BYTES = 16 << 20  # an unchanged tensor that must be decoded is cast and written this much at a time


def row_step(shape: tuple[int, ...], itemsize: int, max_bytes: int, multiple: int = 1) -> int:
    """How many rows (first-axis slices) of a tensor of SHAPE make a block of at most
    MAX_BYTES at ITEMSIZE bytes per value: at least MULTIPLE, and a multiple of it."""
    row = itemsize
    for d in shape[1:]:
        row *= d
    return max(1, max_bytes // max(row * multiple, 1)) * multiple


def _read_index(folder: Path, index_name: str) -> dict[str, Path]:
    return index_map(folder, index_name)  # every shard inside the folder (core/modelfiles.py)


class Source:
    """A read-only view of a model's tensors."""

    def names(self) -> list[str]:  # in an order that reads each file front to back
        raise NotImplementedError

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        raise NotImplementedError

    def get(self, name: str) -> Tensor:
        raise NotImplementedError

    def rows(self, name: str, index: Tensor) -> Tensor:
        """Rows `index` (sorted, unique) of a 2-D tensor; subclasses read only those rows."""
        return self.get(name)[index]

    def blocks(self, name: str, dtype: torch.dtype, max_bytes: int = BLOCK_BYTES) -> Iterator[Tensor]:
        """Tensor NAME cast to DTYPE, as consecutive blocks of its first axis, each at most
        about MAX_BYTES in DTYPE or in the source's own dtype (one row at least; a 0-D or 1-D
        tensor may come whole). Subclasses that can read part of a tensor override this;
        here the tensor is read whole."""
        yield self.get(name).to(dtype)

    def files(self) -> list[Path]:
        return []

    def raw(self, name: str) -> tuple[Path, int, int] | None:
        return None

    def close(self) -> None:
        pass


@dataclass
class Opened:
    """An opened source model: where its config and tokenizer come from, and its tensors."""

    folder: Path          # where config/tokenizer files come from
    gguf: str | None      # the .gguf file in `folder`, for a GGUF source
    config: dict[str, Any]
    source: Source


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
                    dt = FROM_ST.get(header[k]["dtype"])
                    if dt is None:
                        raise GqakitError(f"{path.name}: tensor {k} has unsupported dtype {header[k]['dtype']}")
                    self._meta[k] = (dt, tuple(header[k]["shape"]))
                    begin, end = header[k]["data_offsets"]
                    if end - begin != torch.Size(header[k]["shape"]).numel() * torch.empty((), dtype=dt).element_size():
                        raise GqakitError(f"cannot read {path.name}: truncated or corrupt safetensors file "
                                          f"(tensor {k}: its byte range does not fit its dtype and shape)")
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

    def _read(self, name: str, skip: int, length: int) -> Tensor:
        """LENGTH bytes of tensor NAME from byte SKIP of its data (a uint8 tensor, read into
        memory that is not zeroed first), read with pread rather than through a memory map: a
        file truncated while it is being read then gives a short read, which is one line
        here, instead of a SIGBUS that kills the process."""
        path = self._where[name]
        start, _ = self._range[name]
        buf = torch.empty(length, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        try:
            with open(path, "rb", buffering=0) as f:
                while done < length:
                    n = os.preadv(f.fileno(), [view[done:]], start + skip + done)
                    if n <= 0:
                        break
                    done += n
            size = path.stat().st_size
        except OSError as e:
            raise GqakitError(f"cannot read tensor {name} from {path}: {e.strerror or e}") from None
        finally:
            view.release()
        if done < length:
            raise GqakitError(f"cannot read tensor {name} from {path}: the file is now {size} bytes, shorter than "
                              f"its header says; it was truncated or replaced while gqakit read it")
        return buf

    def _tensor(self, buf: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        if not buf.numel():
            return torch.empty(shape, dtype=dtype)
        return buf.view(dtype).reshape(shape)

    def get(self, name: str) -> Tensor:
        dtype, shape = self._meta[name]
        return self._tensor(self._read(name, 0, self._range[name][1]), dtype, shape)

    def rows(self, name: str, index: Tensor) -> Tensor:
        """Rows `index` of a 2-D tensor, read run by run of consecutive indices (an
        embedding's used rows, without reading the whole matrix)."""
        dtype, shape = self._meta[name]
        row = self._range[name][1] // max(shape[0], 1)
        idx = index.tolist()
        parts, start = [], 0
        for i in range(1, len(idx) + 1):
            if i == len(idx) or idx[i] != idx[i - 1] + 1:
                a, b = idx[start], idx[i - 1] + 1
                parts.append(self._tensor(self._read(name, a * row, (b - a) * row), dtype, (b - a, *shape[1:])))
                start = i
        return torch.cat(parts) if parts else torch.empty((0, *shape[1:]), dtype=dtype)

    def blocks(self, name: str, dtype: torch.dtype, max_bytes: int = BLOCK_BYTES) -> Iterator[Tensor]:
        """Row blocks read with pread and cast one at a time (a dtype change of an unchanged tensor)."""
        src_dtype, shape = self._meta[name]
        if len(shape) < 2 or not shape[0]:
            yield self.get(name).to(dtype)
            return
        row = self._range[name][1] // shape[0]
        itemsize = max(dtype.itemsize, src_dtype.itemsize)
        step = row_step(shape, itemsize, max_bytes)
        for a in range(0, shape[0], step):
            b = min(a + step, shape[0])
            yield self._tensor(self._read(name, a * row, (b - a) * row), src_dtype, (b - a, *shape[1:])).to(dtype)

    def files(self) -> list[Path]:
        return list(self._handles)

    def raw(self, name: str) -> tuple[Path, int, int] | None:
        """(file, offset, length) of a tensor's bytes, for zero-decode pass-through copies."""
        return (self._where[name], *self._range[name])


_read_st_header = read_st_header  # lives in core.modelfiles (no torch needed)


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

    def blocks(self, name: str, dtype: torch.dtype, max_bytes: int = BLOCK_BYTES) -> Iterator[Tensor]:
        """Row blocks cast one at a time (a memory-mapped .bin's values are read as they are cast)."""
        t = self._t[name]
        if t.dim() < 2 or t.dtype == dtype:
            yield t.to(dtype)
            return
        step = row_step(tuple(t.shape), max(dtype.itemsize, t.dtype.itemsize), max_bytes)
        for a in range(0, t.shape[0], step):
            yield t[a:a + step].to(dtype)

    def files(self) -> list[Path]:
        return self._files


_load_bin = load_bin  # weights_only=True: no pickle runs code (core/modelfiles.py)


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


def copy_tensor(source: Source, writer: ShardWriter, name: str, dtype: torch.dtype) -> int:
    """Pass the unchanged tensor NAME from SOURCE into WRITER as DTYPE: its bytes copied by
    the kernel when the source file holds them as they are, else read, cast and written in
    row blocks (`Source.blocks`). Returns the bytes written."""
    raw = _raw(source, name, dtype)
    if raw is not None:
        writer.write_raw(name, *raw)
        return raw[2]
    return writer.write_blocks(name, source.blocks(name, dtype, BLOCK_BYTES))


def _raw(source: Source, name: str, dtype: torch.dtype) -> tuple[Path, int, int] | None:
    """Where the source file holds tensor NAME's bytes as DTYPE (file, offset, length): copied
    as they are; None: decoded and cast."""
    raw = source.raw(name)
    return raw if raw is not None and source.meta(name)[0] == dtype else None


def copied_from(source: Source, plan: Any, dtypes: dict[str, torch.dtype], skip: set[str]) -> dict[str, int]:
    """The source file offset of each of PLAN's pass-through tensors (but SKIP) that
    `copy_tensor` will copy unchanged as its planned dtype (`ShardWriter`'s `origins`)."""
    out: dict[str, int] = {}
    for step in plan.pass_through():
        raw = None if step.name in skip else _raw(source, step.name, dtypes[step.name])
        if raw is not None:
            out[step.name] = raw[1]
    return out
