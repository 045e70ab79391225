"""GGUF out: one .gguf file written in SRC's tensor order.

Every tensor the method does not change is copied as its raw (quantised) bytes; the changed
attention tensors are re-encoded with gguf.quants in `--gguf-type` (q/k rows permuted back
for llama.cpp, see `gguf_in`). The metadata is SRC's key/value pairs byte for byte,
`{arch}.attention.head_count_kv` = G, and the conversion facts under `general.gqakit.*`.
Memory stays flat: the source is memory-mapped, and only one layer's attention is decoded.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import gqakit
from gqakit.convert.gguf_in import GGUFInput, field_value, permute_rows
from gqakit.convert.layout import write_heads
from gqakit.convert.plan import Plan
from gqakit.convert.resolved import ResolvedSettings
from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError
from gqakit.core.run import show_bars

GQAKIT_KEY = "general.gqakit."
# llama.cpp's GGUF architecture for a Llama-layout decoder whose layers have their own head
# counts: its loader reads `deci.attention.head_count` and `head_count_kv` as per-layer arrays
# (the `llama` loader takes one count), with llama's tensor names and q/k row permutation.
PER_LAYER_ARCH = "deci"


def quantisable(qtype: Any) -> bool:
    """True when gguf.quants can encode to QTYPE (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 today)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import quantize

    block = GGML_QUANT_SIZES[qtype][0]
    try:
        quantize(np.zeros((1, block), dtype=np.float32), qtype)
        return True
    except (NotImplementedError, ValueError, AssertionError):
        return False


def parse_gguf_type(name: str | None) -> Any:
    """The GGMLQuantizationType named NAME (case-insensitive), checked to be writable."""
    from gguf import GGMLQuantizationType

    if name is None:
        return None
    try:
        qtype = GGMLQuantizationType[name.upper()]
    except KeyError:
        qtype = None
    if qtype is None or not quantisable(qtype):
        ok = [t.name for t in GGMLQuantizationType if quantisable(t)]
        raise GqakitError(f"--gguf-type {name!r} cannot be written by the gguf package; choose one of {', '.join(ok)}")
    return qtype


def choose_type(src_type: Any, shape: tuple[int, ...], wanted: Any, name: str) -> Any:
    """The type a changed tensor is written in: F32 for 1-D tensors (biases); else WANTED, else
    the source's type when it can be encoded (and its blocks fit the rows), else F16."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def fits(q: Any) -> bool:
        return shape[-1] % GGML_QUANT_SIZES[q][0] == 0

    if len(shape) == 1:  # biases stay F32, as llama.cpp's converter writes every 1-D tensor
        return GGMLQuantizationType.F32
    if wanted is not None:
        if not fits(wanted):
            raise GqakitError(f"--gguf-type {wanted.name}: tensor {name} has rows of {shape[-1]} values, not a "
                              f"multiple of the {GGML_QUANT_SIZES[wanted][0]}-value blocks; choose another type")
        return wanted
    if quantisable(src_type) and fits(src_type):
        return src_type
    return GGMLQuantizationType.F16


def nbytes_of(shape: tuple[int, ...], qtype: Any) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for s in shape:
        n *= s
    return n // block * size


# ----------------------------------------------------------------------------- writing

_SCALAR = {4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d", 0: "<B", 1: "<b", 2: "<H", 3: "<h"}


def _pack_string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def pack_kv(key: str, vtype: int, value: Any, sub_type: int | None = None) -> bytes:
    """One GGUF key/value pair (strings, scalars, arrays of either)."""
    out = _pack_string(key) + struct.pack("<I", vtype)
    if vtype == 8:
        return out + _pack_string(value)
    if vtype == 9:
        assert sub_type is not None
        out += struct.pack("<IQ", sub_type, len(value))
        return out + b"".join(_pack_string(v) if sub_type == 8 else struct.pack(_SCALAR[sub_type], v) for v in value)
    return out + struct.pack(_SCALAR[vtype], value)


def raw_field(reader: Any, field: Any) -> bytes:
    n = sum(int(p.nbytes) for p in field.parts)
    return reader.data[field.offset:field.offset + n].tobytes()


def _pad(n: int, align: int) -> int:
    return -n % align


@dataclass
class Changed:
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]  # numpy (row-major) order
    qtype: Any
    permute_heads: int | None  # re-apply llama.cpp's permutation with this many heads


def changed_tensors(inp: GGUFInput, plan: Plan, G: int, wanted: Any) -> dict[str, Changed]:
    """The tensors the conversion rewrites, by GGUF name, with the type each is written in
    (`wanted`: the `--gguf-type` from `parse_gguf_type`, or None)."""
    source = inp.opened.source
    H, settings = plan.shape.num_heads, plan.settings
    changed: dict[str, Changed] = {}
    planned = {p.name: p.shape for p in plan.tensors}
    for hf in plan.layer_of:
        g, t, shape = source.gguf_name(hf), source.gguf_tensor(hf), planned[hf]
        heads = None
        if inp.permute and ".attn_q." in g:
            heads = H
        elif inp.permute and ".attn_k." in g:
            heads = settings.kv_heads_at(plan.layer_of[hf]) if settings.per_layer else G
        changed[g] = Changed(g, hf, tuple(shape), choose_type(t.tensor_type, tuple(shape), wanted, g), heads)
    return changed


class GGUFWriter:
    """Writes OUT.gguf in one pass: header, key/values, tensor infos, then the data in SRC's order."""

    def __init__(self, path: Path, reader: Any, arch: str, G: int, plan: Plan, settings: ResolvedSettings,
                 changed: dict[str, Changed], staged: bool):
        from gguf import GGUFValueType

        self.path, self.reader, self.plan, self.changed, self.staged = path, reader, plan, changed, staged
        self.align = int(field_value(reader.fields["general.alignment"])) if "general.alignment" in reader.fields \
            else 32
        kv_key = f"{arch}.attention.head_count_kv"
        kvs: list[bytes] = []
        s = plan.shape
        if settings.per_layer:
            kvs = self._per_layer_kvs(reader, arch, plan, settings)
        for name, field in ([] if settings.per_layer else reader.fields.items()):
            if name.startswith("GGUF.") or name.startswith(GQAKIT_KEY):
                continue
            if name == kv_key:
                kvs.append(self._kv_heads(field, G))
            else:
                kvs.append(raw_field(reader, field))
        if kv_key not in reader.fields and not settings.per_layer:
            kvs.append(pack_kv(kv_key, GGUFValueType.UINT32, G))
        facts = {"version": gqakit.__version__, "method": settings.method, "grouping": settings.grouping,
                 "source": Path(settings.source).name, "kv_heads_before": s.num_kv_heads,
                 "kv_heads": json.dumps(list(settings.kv_heads)) if settings.kv_heads else G,
                 "settings": json.dumps(settings.record(), sort_keys=True, default=str)}
        for k, v in facts.items():
            vt = GGUFValueType.UINT32 if isinstance(v, int) else GGUFValueType.STRING
            kvs.append(pack_kv(GQAKIT_KEY + k, vt, v))
        # calibrated methods learn their drift only at the end: reserve fixed-size values now
        self.cal_at: int | None = None
        if staged:
            self.n_drift = s.num_layers
            kvs.append(pack_kv(GQAKIT_KEY + "calibration_tokens", GGUFValueType.UINT64, 0))
            kvs.append(pack_kv(GQAKIT_KEY + "residual_drift", GGUFValueType.ARRAY, [float("nan")] * s.num_layers,
                               GGUFValueType.FLOAT32))
        header = struct.pack("<4sIQQ", b"GGUF", 3, len(reader.tensors), len(kvs))
        blob = header + b"".join(kvs)
        if staged:  # offsets of the two reserved values, from the end of the key/values
            self.cal_at = len(blob) - 4 * s.num_layers  # drift floats
            drift_kv = len(pack_kv(GQAKIT_KEY + "residual_drift", GGUFValueType.ARRAY, [0.0] * s.num_layers,
                                   GGUFValueType.FLOAT32))
            self.tokens_at = len(blob) - drift_kv - 8
        infos, offset = [], 0
        self.order: list[tuple[Any, int]] = []  # (reader tensor, nbytes)
        for t in reader.tensors:
            c = changed.get(t.name)
            dims = [int(x) for x in t.shape.tolist()] if c is None else list(reversed(c.shape))
            qtype = t.tensor_type if c is None else c.qtype
            n = int(t.n_bytes) if c is None else nbytes_of(c.shape, c.qtype)
            infos.append(_pack_string(t.name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                         + struct.pack("<IQ", int(qtype), offset))
            self.order.append((t, n))
            offset += n + _pad(n, self.align)
        blob += b"".join(infos)
        blob += b"\0" * _pad(len(blob), self.align)
        self.total = offset
        self.f = open(path, "wb")
        self.f.write(blob)

    @staticmethod
    def _per_layer_kvs(reader: Any, arch: str, plan: Plan, settings: ResolvedSettings) -> list[bytes]:
        """SRC's key/value pairs under `PER_LAYER_ARCH`: its `{arch}.*` keys renamed, the
        architecture named, and the query and KV head counts as per-layer arrays."""
        from gguf import GGUFValueType

        s, old, new = plan.shape, f"{arch}.", f"{PER_LAYER_ARCH}."
        heads = {f"{new}attention.head_count": [s.num_heads] * s.num_layers,
                 f"{new}attention.head_count_kv": [settings.kv_heads_at(L) for L in range(s.num_layers)]}
        kvs = []
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name.startswith(GQAKIT_KEY):
                continue
            renamed = new + name[len(old):] if name.startswith(old) else name
            if renamed in heads:
                continue
            if name == "general.architecture":
                kvs.append(pack_kv(name, GGUFValueType.STRING, PER_LAYER_ARCH))
                continue
            raw = raw_field(reader, field)
            kvs.append(raw if renamed == name else _pack_string(renamed) + raw[8 + len(name.encode()):])
        kvs += [pack_kv(k, GGUFValueType.ARRAY, v, GGUFValueType.UINT32) for k, v in heads.items()]
        return kvs

    @staticmethod
    def _kv_heads(field: Any, G: int) -> bytes:
        from gguf import GGUFValueType

        name = field.name
        if field.types[0] == GGUFValueType.ARRAY:  # one count per layer: every attention layer gets G
            vals = field_value(field)
            return pack_kv(name, GGUFValueType.ARRAY, [G if v else 0 for v in vals], field.types[-1])
        return pack_kv(name, field.types[0], G)

    def write(self, layers: Iterator[Any]) -> None:
        """Every tensor in file order; a bar as the run context says, unless the calibration stage draws its own."""
        spec = archmod.registry()[self.plan.family]
        ready: dict[str, bytes] = {}  # encoded tensors of layers computed ahead of their turn
        layers = iter(layers)
        bar = tqdm(total=self.total, unit="B", unit_scale=True, desc="converting",
                   disable=not show_bars() or self.staged)
        by_hf = {c.hf_name: c for c in self.changed.values()}
        for t, n in self.order:
            self.f.write(b"\0" * _pad(self.f.tell(), self.align))
            c = self.changed.get(t.name)
            if c is None:
                self.f.write(memoryview(np.ascontiguousarray(t.data)).cast("B"))  # unchanged: the raw bytes
            else:
                while c.gguf_name not in ready:
                    try:
                        layer, new = next(layers)
                    except StopIteration:
                        raise RuntimeError(f"the method produced no value for {c.gguf_name}") from None
                    names = [hf for hf, lay in self.plan.layer_of.items() if lay == layer]
                    for hf, w in write_heads(spec, new, layer, {hf: torch.float32 for hf in names}).items():
                        if hf in by_hf:
                            ready[by_hf[hf].gguf_name] = self.encode(by_hf[hf], w)
                data = ready.pop(c.gguf_name)
                if len(data) != n:
                    raise RuntimeError(f"{c.gguf_name}: encoded {len(data)} bytes, planned {n}")
                self.f.write(data)
            bar.update(n)
        for _ in layers:  # let a stage finish (it records its summary at the end)
            pass
        bar.close()

    @staticmethod
    def encode(c: Changed, w: torch.Tensor) -> bytes:
        from gguf.quants import quantize

        a = w.detach().to(torch.float32).cpu().numpy().reshape(c.shape)
        if c.permute_heads:
            a = permute_rows(a, c.permute_heads)
        return np.ascontiguousarray(quantize(np.ascontiguousarray(a), c.qtype)).tobytes()

    def finish(self, calibration: dict[str, Any] | None, seconds: float) -> None:
        self.f.write(b"\0" * _pad(self.f.tell(), self.align))
        if self.cal_at is not None and calibration:
            drift = list(calibration.get("residual_drift") or [])
            drift = (drift + [float("nan")] * self.n_drift)[:self.n_drift]
            self.f.seek(self.cal_at)
            self.f.write(struct.pack(f"<{self.n_drift}f", *drift))
            self.f.seek(self.tokens_at)
            self.f.write(struct.pack("<Q", int(calibration.get("tokens") or 0)))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()
