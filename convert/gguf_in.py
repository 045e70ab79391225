"""GGUF in: a .gguf file as a conversion source, every tensor under its transformers name,
dequantised one tensor at a time as it is written. Both outputs read GGUF through here:
the model folder (`source.open_model`) and the GGUF file (`gguf_out`).

    SRC.gguf (memory-mapped by gguf.GGUFReader)
      --> GGUFSource: the tensors under transformers' names, each dequantised only when
          asked for, in row chunks (q/k rows un-permuted, see below): into one float32
          array (`get`), or block by block as an unchanged tensor is written (`blocks`:
          memory is a block, not the tensor); the config comes from transformers' GGUF
          metadata reader

Which GGUF tensor is which transformers tensor:
  - the architectures gqakit's GGUF writer knows (`GGUF_ARCHS`, from the `gguf` of the
    architecture table's entries, `core/arch.py`): gguf-py's own tensor-name
    table applied to the state-dict names of the model built on the meta device, with
    llama.cpp's q/k row permutation undone here;
  - any other: transformers' GGUF loader's own name map (`get_gguf_hf_weights_map`) and
    its per-tensor processor (a norm offset, a transpose, ...), when that processor turns
    each GGUF tensor into one transformers tensor of the same name;
  - else there is no map: `stream_gguf` says why, and the caller has transformers load
    the whole model (`source.py`).
The values are transformers' own: the same `gguf.quants.dequantize`, the same processing,
float32 (`tests/test_convert_gguf.py` holds every output tensor to transformers' load).

llama.cpp's `convert_hf_to_gguf.py` stores the rows of Llama q/k projections permuted for
its interleaved ("NORM") RoPE: within each head, the two rotary halves are interleaved
(row order h, i, j -> h, j, i for a [heads, 2, head_dim/2] view). transformers' GGUF
loader reverses that for the `llama` GGUF architecture only (the table entry whose `gguf`
says `permute_qk`). gqakit reverses it when reading
(with the source head counts) and applies it again when writing (with H query heads and
G key heads, `gguf_out`), so both engines see the converted heads correctly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gqakit.convert.io import BLOCK_BYTES, Opened, Source, row_step
from gqakit.core.arch import gguf_archs
from gqakit.core.errors import GqakitError

# GGUF architecture -> whether llama.cpp permutes its q/k rows (transformers' GGUF loader
# un-permutes exactly these: LlamaTensorProcessor), from the table entries' `gguf`. Each is
# tested end to end.
GGUF_ARCHS: dict[str, bool] = gguf_archs()

# transformers' GGUF tensor processors that turn one GGUF tensor into one transformers
# tensor of the same name (the others merge several tensors, e.g. MoE experts)
PER_TENSOR_PROCESSORS = frozenset({"TensorProcessor", "LlamaTensorProcessor", "BloomTensorProcessor",
                                   "MambaTensorProcessor", "NemotronTensorProcessor", "Gemma2TensorProcessor",
                                   "Lfm2TensorProcessor"})

CHUNK_BYTES = 16 << 20  # float32 output dequantised per call: bounds gguf-py's temporaries


def permute_rows(w: np.ndarray, n_head: int, reverse: bool = False) -> np.ndarray:
    """llama.cpp's q/k row permutation for `n_head` heads (`reverse`: transformers' undoing of it)."""
    d2 = w.shape[0] // n_head // 2
    if reverse:
        return w.reshape(n_head, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, d2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def numpy_shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in row-major (numpy, torch) order: GGUF lists dims innermost first."""
    return tuple(int(x) for x in reversed(t.shape.tolist()))


def dequantize(t: Any, path: Path, rows: np.ndarray | slice | None = None) -> np.ndarray:
    """The float32 values of the GGUF tensor T (only ROWS of its first axis, if given: an
    index array or a slice), as `gguf.quants.dequantize` computes them, into one new array:
    a few MiB at a time, so memory is the result and not gguf-py's temporaries (which hold
    the whole tensor twice). A quantised row is whole blocks (GGUF's first dimension is a
    multiple of the block size), so rows never split a block."""
    from gguf.quants import dequantize as gguf_dequantize

    shape = numpy_shape(t)
    data = t.data if rows is None else t.data[rows]
    if rows is not None:
        shape = (data.shape[0], *shape[1:])
    flat = data.reshape(-1, data.shape[-1]) if len(shape) > 1 else data.reshape(1, -1)
    out = np.empty((flat.shape[0], shape[-1]), dtype=np.float32)
    n_rows = flat.shape[0]
    step = max(1, CHUNK_BYTES // max(out.shape[1] * 4, 1))
    try:
        for a in range(0, n_rows, step):
            out[a:a + step] = gguf_dequantize(flat[a:a + step], t.tensor_type)
    except NotImplementedError:
        raise GqakitError(f"{path.name}: tensor {t.name} is {t.tensor_type.name}, which the gguf package "
                          "cannot dequantise") from None
    return out.reshape(shape)


class GGUFSource(Source):
    """The tensors of a GGUF file under their transformers names, dequantised on demand.

    `hf_names`: GGUF name -> transformers name; `shapes`: each transformers tensor's shape;
    `order`: the transformers names, in the model's state-dict order; `permute`: GGUF name ->
    heads to un-permute its rows with; `process`: transformers' processing of one tensor
    (GGUF name, values) -> values, for architectures read through its name map."""

    def __init__(self, reader: Any, path: Path, hf_names: dict[str, str], shapes: dict[str, tuple[int, ...]],
                 order: list[str], permute: dict[str, int],
                 process: Callable[[str, np.ndarray], np.ndarray] | None = None):
        # the tensors only (their bytes stay memory-mapped): not the reader, whose metadata
        # fields (the vocabulary, a few hundred bytes of Python objects per token) are then freed
        self.path = path
        self._t = {t.name: t for t in reader.tensors}
        self._gguf_of = {hf: g for g, hf in hf_names.items()}
        self._shapes, self._order, self._permute, self._process = shapes, order, permute, process

    def names(self) -> list[str]:
        return list(self._order)

    def gguf_name(self, name: str) -> str:
        return self._gguf_of[name]

    def gguf_tensor(self, name: str) -> Any:
        """The reader's record (type, shape, mapped bytes) of the tensor called NAME in transformers."""
        return self._t[self._gguf_of[name]]

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return torch.float32, self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        g = self._gguf_of[name]
        w = dequantize(self._t[g], self.path)  # a new array: never a view of the mapped file
        if g in self._permute:
            w = permute_rows(w, self._permute[g], reverse=True)
        if self._process is not None:
            w = np.ascontiguousarray(self._process(g, w), dtype=np.float32)
        if tuple(w.shape) != self._shapes[name]:
            raise GqakitError(f"{self.path.name}: tensor {g} has shape {tuple(w.shape)}, but the model needs "
                              f"{self._shapes[name]} for {name}")
        return torch.from_numpy(w)

    def blocks(self, name: str, dtype: torch.dtype, max_bytes: int = BLOCK_BYTES) -> Iterator[torch.Tensor]:
        """Row blocks of at most about MAX_BYTES of float32, dequantised one at a time; a
        block of a permuted q/k holds whole heads, so each is un-permuted on its own. A
        tensor that transformers processes, or a 1-D one, comes whole."""
        g = self._gguf_of[name]
        shape = self._shapes[name]
        if self._process is not None or len(shape) < 2 or numpy_shape(self._t[g]) != shape:
            yield self.get(name).to(dtype)
            return
        heads = self._permute.get(g)
        per_head = shape[0] // heads if heads else 1
        step = row_step(shape, max(4, dtype.itemsize), max_bytes, per_head)
        for a in range(0, shape[0], step):
            w = dequantize(self._t[g], self.path, rows=slice(a, a + step))
            if heads:
                w = permute_rows(w, w.shape[0] // per_head, reverse=True)
            yield torch.from_numpy(w).to(dtype)
            del w

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of a 2-D tensor, dequantising only those (an embedding's used rows)."""
        g = self._gguf_of[name]
        if g in self._permute or self._process is not None or len(self._shapes[name]) != 2:
            return super().rows(name, index)
        return torch.from_numpy(dequantize(self._t[g], self.path, rows=index.numpy()))

    def files(self) -> list[Path]:
        return [self.path]


def field_value(field: Any) -> Any:
    from gguf import GGUFValueType

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        return [field.parts[i].tolist()[0] if field.types[-1] != GGUFValueType.STRING else bytes(field.parts[i])
                for i in field.data]
    p = field.parts[field.data[0]]
    return bytes(p).decode("utf-8", "replace") if field.types[0] == GGUFValueType.STRING else p.tolist()[0]


def gguf_names(skeleton: Any, arch: str, present: set[str]) -> dict[str, str]:
    """GGUF tensor name -> transformers name, by gguf-py's own name table (the one
    transformers' GGUF loader uses), for the tensors PRESENT in the file."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    key = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(key, skeleton.config.num_hidden_layers)
    out: dict[str, str] = {}
    for hf in skeleton.state_dict():
        base, dot, suffix = hf.rpartition(".")
        g = table.get_name(base) if suffix in ("weight", "bias") else None
        if g is not None and f"{g}.{suffix}" in present:
            out.setdefault(f"{g}.{suffix}", hf)
    return out


def transformers_names(path: Path, arch: str, skeleton: Any, present: set[str]) \
        -> tuple[dict[str, str], Callable[[str, np.ndarray], np.ndarray]] | str:
    """transformers' GGUF loader's name map (GGUF name -> transformers name, for the tensors
    PRESENT) and its processing of one tensor; or why it cannot be read tensor by tensor."""
    try:
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map, load_gguf_checkpoint)
    except ImportError:
        return f"no tensor-name map for the {arch!r} GGUF architecture (this transformers has no GGUF loader)"
    cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if cls.__name__ not in PER_TENSOR_PROCESSORS:
        return (f"the {arch!r} GGUF architecture is read by transformers' {cls.__name__}, which merges several "
                "GGUF tensors into one")
    try:
        processor = cls(config=load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        mapping = get_gguf_hf_weights_map(skeleton, processor)
    except (NotImplementedError, ValueError, KeyError, TypeError, AttributeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return f"no tensor-name map for the {arch!r} GGUF architecture ({first})"
    hf_names = {g: hf for g, hf in mapping.items() if g in present}

    def process(g: str, w: np.ndarray) -> np.ndarray:
        r = processor.process(weights=w, name=g, tensor_key_mapping=mapping, parsed_parameters={"tensors": {}})
        if r.name != g:
            raise GqakitError(f"{path.name}: transformers' {cls.__name__} renamed tensor {g}; "
                              "this GGUF architecture cannot be read tensor by tensor")
        return r.weights

    return hf_names, process


@dataclass
class GGUFInput:
    reader: Any
    arch: str
    permute: bool
    opened: Opened  # with a GGUFSource


@dataclass
class NoStream:
    """Why a GGUF file cannot be read tensor by tensor, and the bytes of its float32 tensors."""

    reason: str
    float32_bytes: int


def read_gguf(path: Path) -> tuple[Any, str | None]:
    """The memory-mapped reader of PATH (checked: structure and metadata) and its architecture."""
    from gguf import GGUFReader

    from gqakit.core.loading import check_gguf

    check_gguf(path)
    reader = GGUFReader(path)
    arch_field = reader.fields.get("general.architecture")
    return reader, field_value(arch_field) if arch_field is not None else None


def float32_bytes(reader: Any) -> int:
    return sum(int(np.prod(numpy_shape(t))) * 4 for t in reader.tensors)


def open_gguf_source(path: Path) -> GGUFInput:
    """Memory-map PATH for GGUF output (an architecture of `GGUF_ARCHS`); nothing is decoded."""
    reader, arch = read_gguf(path)
    if reader.byte_order != "I":
        raise GqakitError(f"{path.name} is a big-endian GGUF file; gqakit writes little-endian GGUF only")
    if arch not in GGUF_ARCHS:
        raise GqakitError(f"GGUF output does not support the {arch!r} GGUF architecture of {path.name} (supported: "
                          f"{', '.join(GGUF_ARCHS)}); write a model folder instead: gqakit convert {path.name} OUTDIR")
    got = _stream(path, reader, arch, gguf_config(path))
    assert isinstance(got, GGUFInput)  # a GGUF_ARCHS file always has its map
    return got


def stream_gguf(path: Path) -> GGUFInput | NoStream:
    """PATH memory-mapped for the folder output, every tensor under its transformers name,
    nothing decoded; or, for an architecture with no name map, why not (`NoStream`).

    The config is read first: transformers parses the whole metadata (the vocabulary) into
    Python objects, and that is freed before gqakit's own reader parses it again, so the two
    peaks do not add up."""
    config = gguf_config(path)
    reader, arch = read_gguf(path)
    if reader.byte_order != "I":
        return NoStream("a big-endian GGUF file is not read tensor by tensor", float32_bytes(reader))
    return _stream(path, reader, arch, config)


def gguf_config(path: Path) -> Any:
    """transformers' config of the GGUF file PATH (checked first, `core.loading`)."""
    from gqakit.core.loading import load_config

    return load_config(path)


def _stream(path: Path, reader: Any, arch: Any, config: Any) -> GGUFInput | NoStream:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from gqakit.core.modelfiles import check_loaded

    if getattr(config, "is_encoder_decoder", False):
        raise GqakitError(f"{path.name} holds an encoder-decoder ({config.model_type}); GGUF input and output are "
                          "for decoder-only models: convert its model folder to a model folder")
    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(config)
    present = {t.name for t in reader.tensors}
    permute: dict[str, int] = {}
    process = None
    if arch in GGUF_ARCHS:
        hf_names = gguf_names(skeleton, arch, present)
        if GGUF_ARCHS[arch]:
            heads = int(config.num_attention_heads)
            kv = int(getattr(config, "num_key_value_heads", None) or heads)
            permute = {g: heads if ".attn_q." in g else kv for g in hf_names if ".attn_q." in g or ".attn_k." in g}
    else:
        got = transformers_names(path, arch, skeleton, present)
        if isinstance(got, str):
            return NoStream(got, float32_bytes(reader))
        hf_names, process = got
    cfg = config.to_dict()
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(skeleton).__name__]
    for k in ("_name_or_path", "_model_name_or_path", "quantization_config"):
        cfg.pop(k, None)
    cfg["dtype"] = "float32"  # the tensors are dequantised to float32, as transformers loads them
    mapped = set(hf_names.values())
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    tied = bool(cfg.get("tie_word_embeddings"))
    order = [k for k in shapes if k in mapped and not (tied and k == "lm_head.weight")]
    missing = [k for k in shapes if k not in mapped and not (tied and k == "lm_head.weight")]
    if missing and process is not None:
        return NoStream(f"transformers' name map for the {arch!r} GGUF architecture leaves {missing[0]} without "
                        "a GGUF tensor", float32_bytes(reader))
    check_loaded({"missing_keys": missing}, path, type(skeleton).__name__)
    source = GGUFSource(reader, path, hf_names, shapes, order, permute, process)
    for hf in order:  # every shape before anything is written (transformers' processing keeps the size)
        have = numpy_shape(source.gguf_tensor(hf))
        if have != shapes[hf] if process is None else int(np.prod(have)) != int(np.prod(shapes[hf])):
            raise GqakitError(f"{path.name}: tensor {source.gguf_name(hf)} has shape {have}, but the model "
                              f"needs {shapes[hf]} for {hf}")
    return GGUFInput(reader, arch, bool(GGUF_ARCHS.get(arch)), Opened(path.parent, path.name, cfg, source))
