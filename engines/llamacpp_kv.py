"""llama.cpp's KV cache in bytes, read from llama.cpp itself, and gqakit's prediction of it.

Pure byte arithmetic, no llama_cpp import: `read_kv_state` parses the bytes llama.cpp writes
for one sequence (`llama_state_seq_get_data`: a magic number and the sequence id; per cell its
position and sequences; then per layer the K type, the K row size and the rows, then the same
for V, transposed or not), so the per-token size comes from the cache's own tensors: their
ggml type and row size.
`predicted_bytes_per_token` is what the GGUF's geometry says: 2 x layers x KV heads x
head_dim elements of the cache type (for F16, 2 bytes each).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gqakit.core.errors import GqakitError


def ggml_type_name(type_id: int) -> str:
    """ggml's name of a type id (1 -> 'F16'), from gguf-py's table."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"ggml type {type_id}"


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of N elements of a ggml type (a quantised type stores blocks: n / block x block bytes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if n % block:
        raise GqakitError(f"a KV row of {n} values is not a whole number of {type_name} blocks of {block}")
    return n // block * size


@dataclass(frozen=True)
class KvState:
    """What one sequence's state says about the cache: per layer, the type and row bytes of K and V."""

    cells: int
    k_types: tuple[str, ...]
    k_rows: tuple[int, ...]
    v_types: tuple[str, ...]
    v_rows: tuple[int, ...]
    v_trans: bool

    @property
    def bytes_per_token(self) -> int:
        return sum(self.k_rows) + sum(self.v_rows)


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            raise ValueError("past the end")
        (v,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return v

    def skip(self, n: int) -> None:
        if n < 0 or self.at + n > len(self.buf):
            raise ValueError("past the end")
        self.at += n


STATE_MAGIC = 0xAF143CD8  # llama-context.cpp's io_magic: the first 4 bytes of a state llama.cpp writes


def _parse(buf: bytes, n_layer: int, meta: int) -> KvState:
    r = _Reader(buf)
    if r.take("<I") != STATE_MAGIC:
        raise ValueError("magic")
    r.take("<i")  # the sequence id
    if r.take("<I") != 1:
        raise ValueError("not one stream")
    cells = r.take("<I")
    if cells == 0:
        raise ValueError("no cells")
    r.skip(cells * meta)
    v_trans = r.take("<I")
    if v_trans not in (0, 1) or r.take("<I") != n_layer:
        raise ValueError("layer header")
    k_types, k_rows = [], []
    for _ in range(n_layer):
        k_types.append(r.take("<i"))
        k_rows.append(r.take("<Q"))
        r.skip(cells * k_rows[-1])
    v_types, v_rows = [], []
    while r.at < len(buf):  # a layer without V (shared K/V) writes nothing
        v_types.append(r.take("<i"))
        if v_trans:
            el, n_embd = r.take("<I"), r.take("<I")
            v_rows.append(el * n_embd)
        else:
            v_rows.append(r.take("<Q"))
        r.skip(cells * v_rows[-1])
    if len(v_rows) > n_layer or not all(0 <= t < 64 for t in k_types + v_types) or not all(k_rows):
        raise ValueError("layer records")
    return KvState(cells, tuple(map(ggml_type_name, k_types)), tuple(k_rows), tuple(map(ggml_type_name, v_types)),
                   tuple(v_rows), bool(v_trans))


def read_kv_state(buf: bytes, n_layer: int) -> KvState:
    """Parse one sequence's KV state as llama.cpp writes it (`llama_state_seq_get_data`: the
    magic number and the sequence id, then the cache's `state_write`). A cell's metadata is its position,
    its sequence count and ids, and (M-RoPE models) an extension of unknown size: the size that
    makes the whole buffer parse, layer count included, is the one used."""
    for meta in range(12, 69, 4):
        try:
            return _parse(buf, n_layer, meta)
        except (ValueError, struct.error):
            continue
    raise GqakitError(f"llama.cpp's KV state ({len(buf)} bytes) is not in the layout this gqakit reads "
                      f"({n_layer} layers, one stream); report the llama-cpp-python version")


def gguf_geometry(metadata: Mapping[str, str]) -> dict[str, int]:
    """Layers, query heads, KV heads and K/V head sizes from a GGUF's metadata (as llama_cpp's
    `Llama.metadata` gives it: strings)."""
    arch = metadata.get("general.architecture")
    if not arch:
        raise GqakitError("the GGUF has no general.architecture")

    def get(key: str, default: int | None = None) -> int:
        v = metadata.get(f"{arch}.{key}")
        if v is None:
            if default is None:
                raise GqakitError(f"the GGUF has no {arch}.{key}")
            return default
        return int(v)

    if metadata.get(f"{arch}.attention.head_count") is None and metadata.get(f"{arch}.rope.dimension_count"):
        # per-layer head counts (llama.cpp's deci): arrays, which llama-cpp-python's metadata
        # leaves out; kv_heads None: no one count for every layer
        head_dim = get("rope.dimension_count")
        return {"layers": get("block_count"), "heads": 0, "kv_heads": 0,
                "head_dim_k": get("attention.key_length", head_dim), "head_dim_v": get("attention.value_length", head_dim)}
    heads = get("attention.head_count")
    head_dim = get("embedding_length") // heads
    return {"layers": get("block_count"), "heads": heads, "kv_heads": get("attention.head_count_kv", heads),
            "head_dim_k": get("attention.key_length", head_dim), "head_dim_v": get("attention.value_length", head_dim)}


def predicted_bytes_per_token(geometry: Mapping[str, int], type_k: str = "F16", type_v: str = "F16") -> int:
    """gqakit's prediction: every layer caches kv_heads x head_dim values of K and of V per token
    (F16: 2 x layers x kv_heads x head_dim x 2 bytes)."""
    kv = geometry["kv_heads"]
    return geometry["layers"] * (row_bytes(type_k, kv * geometry["head_dim_k"])
                                 + row_bytes(type_v, kv * geometry["head_dim_v"]))


def gguf_step_weight_bytes(path: Any) -> int:
    """Bytes of weights one decode step reads from a GGUF, in its own tensor types: every
    tensor, but of the token embedding only one row when an output matrix of its own is the LM
    head (a lookup reads one row; a tied embedding is read whole as the LM head)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        emb = tensors["token_embd.weight"]
        total -= int(emb.n_bytes) - int(emb.n_bytes) // int(emb.shape[-1])
    return total

