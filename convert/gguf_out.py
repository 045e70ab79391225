"""GGUF in, GGUF out: convert a .gguf file to GQA and write one .gguf file back.

    SRC.gguf (memory-mapped by gguf.GGUFReader)
      --> GGUFSource: the tensors under transformers' names, each dequantised only when
          asked for (q/k rows un-permuted, see below); the config comes from transformers'
          GGUF metadata reader
      --> the usual plan and method (per layer, or align-refit's block-by-block stage)
      --> OUT.gguf, written tensor by tensor in SRC's order: every tensor the method does
          not change is copied as its raw (quantised) bytes; the changed attention
          tensors are re-encoded with gguf.quants in `--gguf-type`
      --> metadata: SRC's key/value pairs byte for byte, `{arch}.attention.head_count_kv`
          = G, and the conversion facts under `general.gqakit.*`; atomic rename to OUT

Memory stays flat: the source is memory-mapped, and only one layer's attention (or, for
align-refit, one decoder block and its hidden-state streams) is ever decoded.

llama.cpp's `convert_hf_to_gguf.py` stores the rows of Llama q/k projections permuted for
its interleaved ("NORM") RoPE: within each head, the two rotary halves are interleaved
(row order h, i, j -> h, j, i for a [heads, 2, head_dim/2] view). transformers' GGUF
loader reverses that for the `llama` architecture only. gqakit reverses it when reading
(with the source head counts) and applies it again when writing (with H query heads and
G key heads), so both engines see the converted heads correctly.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import gqakit
from gqakit.convert.io import Source
from gqakit.core.errors import GqakitError

# GGUF architecture -> whether llama.cpp permutes its q/k rows (transformers' GGUF loader
# un-permutes exactly these: LlamaTensorProcessor). Each entry is tested end to end.
GGUF_ARCHS: dict[str, bool] = {"llama": True, "qwen2": False}
GQAKIT_KEY = "general.gqakit."


def permute_rows(w: np.ndarray, n_head: int, reverse: bool = False) -> np.ndarray:
    """llama.cpp's q/k row permutation for `n_head` heads (`reverse`: transformers' undoing of it)."""
    d2 = w.shape[0] // n_head // 2
    if reverse:
        return w.reshape(n_head, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, d2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- reading


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


def _field_value(field: Any) -> Any:
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
    opened: Any  # pipeline.Opened with a GGUFSource


def open_gguf_source(path: Path) -> GGUFInput:
    """Memory-map PATH and describe it as the conversion pipeline expects; nothing is decoded."""
    from gguf import GGUFReader

    from gqakit.convert.pipeline import Opened
    from gqakit.core.loading import check_gguf, load_config

    check_gguf(path)
    reader = GGUFReader(path)
    if reader.byte_order != "I":
        raise GqakitError(f"{path.name} is a big-endian GGUF file; gqakit writes little-endian GGUF only")
    arch_field = reader.fields.get("general.architecture")
    arch = _field_value(arch_field) if arch_field is not None else None
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


# ----------------------------------------------------------------------------- types


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


def _raw_field(reader: Any, field: Any) -> bytes:
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


def convert_gguf(src: str | Path, out: str | Path, num_kv_heads: int, method: str | None = None, *,
                 grouping: str = "contiguous", gguf_type: str | None = None, overwrite: bool = False, seed: int = 0,
                 calibration_data: str | None = None, calibration_tokens: int | None = None,
                 options: dict[str, Any] | None = None, device: str = "auto", progress: bool = True,
                 dry_run: bool = False) -> Path | list[str]:
    """Convert SRC.gguf to OUT.gguf with `num_kv_heads` KV heads (see the module docstring).

    `dry_run`: check everything, write nothing, and return the plan as lines of text."""
    from gqakit.convert.pipeline import (DEFAULT_CALIBRATION_TOKENS, Settings, check_settings, converted_layers,
                                         make_plan)
    from gqakit.core.device import resolve_device
    from gqakit.convert.methods import DEFAULT_METHOD
    from gqakit.core.outdir import GGUF_FILE, atomic_output_file, check_output_path

    method = DEFAULT_METHOD if method is None else method
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if not src.exists():
        raise GqakitError(f"source not found: {src}")
    if not (src.is_file() and src.suffix.lower() == ".gguf"):
        raise GqakitError(f"a .gguf OUT needs a .gguf SRC (got {src}); a model folder converts to a folder, "
                          "or to GGUF with llama.cpp's convert_hf_to_gguf.py")
    tokens = DEFAULT_CALIBRATION_TOKENS if calibration_tokens is None else calibration_tokens
    settings = Settings(str(src.resolve()), num_kv_heads, method, grouping, "auto", "-", seed, calibration_data,
                        tokens, options or {})
    staged = check_settings(settings)  # every setting checked before anything is read or written
    from gqakit.convert.calibrate import refit_options, trains_block

    if staged and trains_block(refit_options(options)):  # (the source's K/V head count is not read yet)
        raise GqakitError("--refit-option train=block rewrites every block's weights: convert to a model folder, "
                          "not to GGUF (a GGUF OUT keeps the unchanged tensors' quantised bytes)")
    wanted = parse_gguf_type(gguf_type)
    dev = resolve_device(device)
    calib_file = calibration_data if calibration_data and not str(calibration_data).startswith("hf:") else None
    inputs = [("source", src), ("calibration data", calib_file)]
    check_output_path(out, overwrite=overwrite, inputs=inputs, kind=GGUF_FILE)
    inp = open_gguf_source(src)
    opened, reader = inp.opened, inp.reader
    plan = make_plan(opened, settings)
    source: GGUFSource = opened.source
    H, G = plan.shape.num_heads, num_kv_heads
    changed: dict[str, Changed] = {}
    planned = {p.name: p.shape for p in plan.tensors}
    for hf in plan.layer_of:
        g, t, shape = source.gguf_name(hf), source.gguf_tensor(hf), planned[hf]
        heads = None
        if inp.permute and ".attn_q." in g:
            heads = H
        elif inp.permute and ".attn_k." in g:
            heads = G
        changed[g] = Changed(g, hf, tuple(shape), choose_type(t.tensor_type, tuple(shape), wanted, g), heads)
    if dry_run:
        s = plan.shape
        kinds = sorted({f"{c.qtype.name}" for c in changed.values()})
        return [f"{plan.family} (GGUF {inp.arch}): {s.num_layers} layers, {s.num_heads} query heads, "
                f"{s.num_kv_heads} -> {G} KV heads, head_dim {s.head_dim}",
                f"{len(reader.tensors)} tensors: {len(reader.tensors) - len(changed)} copied as they are, "
                f"{len(changed)} re-encoded as {', '.join(kinds)}; method {method}; nothing written (dry run)"]

    t0 = time.perf_counter()
    if progress:
        tqdm.write(f"{src.name} (GGUF {inp.arch}, memory-mapped): {len(reader.tensors) - len(changed)} tensors "
                   f"copied as they are, {len(changed)} converted", file=sys.stderr)
    with atomic_output_file(out, overwrite=overwrite, inputs=inputs, kind=GGUF_FILE) as (tmp, scratch):
        writer = _Writer(tmp, reader, inp.arch, G, plan, settings, changed, staged)
        layers, stage = converted_layers(opened, plan, settings, device=dev, progress=progress, scratch=scratch,
                                         resume_dir=None, written=lambda: [])
        try:
            writer.write(layers, progress=progress and not staged)
            calibration = stage.summary if stage is not None else None
            writer.finish(calibration, time.perf_counter() - t0)
        finally:
            writer.close()
        if calibration and progress:
            from gqakit.convert.pipeline import drift_summary

            tqdm.write(drift_summary(calibration))
    return out.resolve()


class _Writer:
    """Writes OUT.gguf in one pass: header, key/values, tensor infos, then the data in SRC's order."""

    def __init__(self, path: Path, reader: Any, arch: str, G: int, plan: Any, settings: Any,
                 changed: dict[str, Changed], staged: bool):
        from gguf import GGUFValueType

        self.path, self.reader, self.plan, self.changed = path, reader, plan, changed
        self.align = int(_field_value(reader.fields["general.alignment"])) if "general.alignment" in reader.fields \
            else 32
        kv_key = f"{arch}.attention.head_count_kv"
        kvs: list[bytes] = []
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name.startswith(GQAKIT_KEY):
                continue
            if name == kv_key:
                kvs.append(self._kv_heads(field, G))
            else:
                kvs.append(_raw_field(reader, field))
        if kv_key not in reader.fields:
            kvs.append(pack_kv(kv_key, GGUFValueType.UINT32, G))
        s = plan.shape
        facts = {"version": gqakit.__version__, "method": settings.method, "grouping": settings.grouping,
                 "source": Path(settings.source).name, "kv_heads_before": s.num_kv_heads, "kv_heads": G,
                 "settings": json.dumps(asdict(settings), sort_keys=True, default=str)}
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
    def _kv_heads(field: Any, G: int) -> bytes:
        from gguf import GGUFValueType

        name = field.name
        if field.types[0] == GGUFValueType.ARRAY:  # one count per layer: every attention layer gets G
            vals = _field_value(field)
            return pack_kv(name, GGUFValueType.ARRAY, [G if v else 0 for v in vals], field.types[-1])
        return pack_kv(name, field.types[0], G)

    def write(self, layers: Iterator[Any], *, progress: bool) -> None:
        from gqakit.core import arch as archmod
        from gqakit.convert.layout import write_heads

        spec = archmod.registry()[self.plan.family]
        ready: dict[str, bytes] = {}  # encoded tensors of layers computed ahead of their turn
        layers = iter(layers)
        bar = tqdm(total=self.total, unit="B", unit_scale=True, desc="converting", disable=not progress)
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
                            ready[by_hf[hf].gguf_name] = self._encode(by_hf[hf], w)
                data = ready.pop(c.gguf_name)
                if len(data) != n:
                    raise RuntimeError(f"{c.gguf_name}: encoded {len(data)} bytes, planned {n}")
                self.f.write(data)
            bar.update(n)
        for _ in layers:  # let a stage finish (it records its summary at the end)
            pass
        bar.close()

    @staticmethod
    def _encode(c: Changed, w: torch.Tensor) -> bytes:
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
