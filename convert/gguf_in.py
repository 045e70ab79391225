"""GGUF in: a .gguf file as a conversion source, every tensor under its transformers name.

    SRC.gguf (memory-mapped by gguf.GGUFReader)
      --> GGUFSource: the tensors under transformers' names, each dequantised only when
          asked for (q/k rows un-permuted, see below); the config comes from transformers'
          GGUF metadata reader

llama.cpp's `convert_hf_to_gguf.py` stores the rows of Llama q/k projections permuted for
its interleaved ("NORM") RoPE: within each head, the two rotary halves are interleaved
(row order h, i, j -> h, j, i for a [heads, 2, head_dim/2] view). transformers' GGUF
loader reverses that for the `llama` architecture only. gqakit reverses it when reading
(with the source head counts) and applies it again when writing (with H query heads and
G key heads, `gguf_out`), so both engines see the converted heads correctly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gqakit.convert.io import Source
from gqakit.convert.source import Opened
from gqakit.core.errors import GqakitError

# GGUF architecture -> whether llama.cpp permutes its q/k rows (transformers' GGUF loader
# un-permutes exactly these: LlamaTensorProcessor). Each entry is tested end to end.
GGUF_ARCHS: dict[str, bool] = {"llama": True, "qwen2": False}


def permute_rows(w: np.ndarray, n_head: int, reverse: bool = False) -> np.ndarray:
    """llama.cpp's q/k row permutation for `n_head` heads (`reverse`: transformers' undoing of it)."""
    d2 = w.shape[0] // n_head // 2
    if reverse:
        return w.reshape(n_head, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, d2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource(Source):
    """The tensors of a GGUF file under their transformers names, dequantised on demand."""

    def __init__(self, reader: Any, hf_names: dict[str, str], permute: dict[str, int], path: Path):
        self.reader, self.path = reader, path
        self._t = {t.name: t for t in reader.tensors}
        self._gguf_of = {hf: g for g, hf in hf_names.items()}
        self._order = [hf_names[t.name] for t in reader.tensors if t.name in hf_names]
        self._permute = permute  # gguf name -> heads to un-permute its rows with

    def names(self) -> list[str]:
        return list(self._order)

    def gguf_name(self, name: str) -> str:
        return self._gguf_of[name]

    def gguf_tensor(self, name: str) -> Any:
        """The reader's record (type, shape, mapped bytes) of the tensor called NAME in transformers."""
        return self._t[self._gguf_of[name]]

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        t = self._t[self._gguf_of[name]]
        return torch.float32, tuple(int(x) for x in reversed(t.shape.tolist()))

    def get(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        g = self._gguf_of[name]
        t = self._t[g]
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GqakitError(f"{self.path.name}: tensor {g} is {t.tensor_type.name}, which the gguf package "
                              "cannot dequantise") from None
        w = np.asarray(w, dtype=np.float32).reshape(self.meta(name)[1])
        if g in self._permute:
            w = permute_rows(w, self._permute[g], reverse=True)
        return torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: never a view of the mapped file

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


@dataclass
class GGUFInput:
    reader: Any
    arch: str
    permute: bool
    opened: Opened  # with a GGUFSource


def open_gguf_source(path: Path) -> GGUFInput:
    """Memory-map PATH and describe it as the conversion pipeline expects; nothing is decoded."""
    from gguf import GGUFReader

    from gqakit.core.loading import check_gguf, load_config

    check_gguf(path)
    reader = GGUFReader(path)
    if reader.byte_order != "I":
        raise GqakitError(f"{path.name} is a big-endian GGUF file; gqakit writes little-endian GGUF only")
    arch_field = reader.fields.get("general.architecture")
    arch = field_value(arch_field) if arch_field is not None else None
    if arch not in GGUF_ARCHS:
        raise GqakitError(f"GGUF output does not support the {arch!r} GGUF architecture of {path.name} (supported: "
                          f"{', '.join(GGUF_ARCHS)}); write a model folder instead: gqakit convert {path.name} OUTDIR")
    config = load_config(path)
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(config)
    hf_names = gguf_names(skeleton, arch, {t.name for t in reader.tensors})
    cfg = config.to_dict()
    cfg["architectures"] = [type(skeleton).__name__]
    for k in ("_name_or_path", "quantization_config"):
        cfg.pop(k, None)
    cfg["dtype"] = "float32"
    permute: dict[str, int] = {}
    if GGUF_ARCHS[arch]:
        for g in hf_names:
            if ".attn_q." in g:
                permute[g] = int(cfg["num_attention_heads"])
            elif ".attn_k." in g:
                permute[g] = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    source = GGUFSource(reader, hf_names, permute, path)
    return GGUFInput(reader, arch, GGUF_ARCHS[arch], Opened(path.parent, path.name, cfg, source))
