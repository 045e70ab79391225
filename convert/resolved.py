"""The settings of one conversion with every "auto" decided: `ResolvedSettings`.

`plan.make_plan` builds them once (`resolve_settings`), when the model's parameters and
context and the output kind are known, and everything after it (the per-layer methods, the
calibration stage, the writers, the record, the resume fingerprint) takes this object: the
grouping is a grouping's name, the method's options are its resolved model (align-refit's
`refit_options.ResolvedRefitOptions`), the output dtype is a dtype or None (each tensor's
own), and the output kind is a field. `reasons` says what each "auto" became and why.
Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gqakit.convert.settings import ConvertSettings, parse_size
from gqakit.core.errors import GqakitError
from gqakit.core.methods import MethodSpec, load, method_spec
from gqakit.core.text import TextSource

Output = Literal["folder", "gguf"]


@dataclass(frozen=True)
class Device:
    """The device a conversion computes on, as its settings are resolved for it."""

    name: str       # "cpu", "cuda", "cuda:1", "mps"
    free: int       # bytes free on it (host memory for the CPU)
    host_free: int  # bytes of host memory free
    bf16: bool = False  # it multiplies bfloat16 natively (a recent GPU; a CPU with AVX512-BF16 or AMX)

    @property
    def gpu(self) -> bool:
        return self.name.startswith("cuda")


def device_facts(device: str = "cpu") -> Device:
    """`device` (resolved: not "auto") with its free memory and the host's, measured now."""
    from gqakit.core import device as devices

    host = devices.available_memory("cpu")
    return Device(device, host if device == "cpu" else devices.available_memory(device), host, native_bf16(device))


def native_bf16(device: str) -> bool:
    """Whether `device` multiplies bfloat16 natively: a CUDA GPU that supports it, or a CPU whose
    oneDNN kernels have bfloat16 instructions (AVX512-BF16, AMX)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return dev.type == "cpu" and probe is not None and bool(probe())
    except RuntimeError:
        return False


@dataclass(frozen=True)
class ResolvedSettings:
    asked: ConvertSettings          # the settings as given (the record's "options" are these)
    grouping: str                   # a name in `grouping.GROUPINGS`
    options: Any                    # the method's options, resolved (NoOptions for a method without)
    output: Output                  # a model folder or one GGUF file
    dtype: str | None               # the output dtype; None keeps each tensor's
    max_shard_bytes: int | None     # a folder's largest shard; None for a GGUF file
    reasons: dict[str, str] = field(default_factory=dict)  # what each "auto" chose, and why
    # the KV heads of each decoder layer (0-based) when they differ; None: `num_kv_heads` in every
    # layer (a uniform plan is normalised to None, so it is exactly the -g conversion)
    kv_heads: tuple[int, ...] | None = None
    uniform_kv_heads: int | None = None  # G of a uniform plan given as a per-layer list
    kv_choice: dict[str, Any] | None = None  # --kv-budget: the allocation's record (`budget.choose.KvChoice`)

    def __post_init__(self) -> None:
        if self.grouping == "auto" or (self.output == "folder") != (self.max_shard_bytes is not None):
            raise GqakitError(f"settings not resolved: grouping {self.grouping}, output {self.output}, "
                              f"shard size {self.max_shard_bytes}")
        left = [k for k in getattr(type(self.options), "model_fields", {}) if getattr(self.options, k) == "auto"]
        if left:  # the stage only reads the options: each is decided before it
            raise GqakitError(f"settings not resolved: {', '.join(left)} still auto")

    # the settings as asked, where "auto" never applied
    @property
    def source(self) -> str:
        return self.asked.source

    @property
    def source_hub(self) -> dict[str, str] | None:
        return self.asked.source_hub

    @property
    def source_name(self) -> str:
        return self.asked.source_name

    @property
    def num_kv_heads(self) -> int:
        """G of a uniform conversion; the largest layer's KV heads of a per-layer one."""
        if self.kv_heads is not None:
            return max(self.kv_heads)
        g = self.asked.num_kv_heads if self.asked.num_kv_heads is not None else self.uniform_kv_heads
        assert g is not None, "settings not resolved: no KV heads"
        return g

    @property
    def per_layer(self) -> bool:
        """True when the layers get different KV heads."""
        return self.kv_heads is not None

    def kv_heads_at(self, layer: int) -> int:
        """The KV heads of decoder layer `layer` (0-based)."""
        return self.num_kv_heads if self.kv_heads is None else self.kv_heads[layer]

    @property
    def method(self) -> str:
        return self.asked.method

    @property
    def spec(self) -> MethodSpec:
        return method_spec(self.asked.method)

    @property
    def effort(self) -> str:
        return self.asked.effort

    @property
    def seed(self) -> int:
        return self.asked.seed

    @property
    def calibration_tokens(self) -> int:
        return self.asked.calibration_tokens

    @property
    def calibration_data(self) -> str | None:
        return self.asked.calibration_data

    @property
    def calibration_file(self) -> Path | None:
        return TextSource(self.calibration_data).file if self.calibration_data else None

    @property
    def group_encoder(self) -> bool:
        return self.asked.group_encoder

    @property
    def staged(self) -> bool:
        """True when the method calibrates on data: the calibration stage makes its layers."""
        return self.spec.needs_data

    def auto_reasons(self) -> dict[str, str]:
        """What each "auto" setting resolved to, and why."""
        return dict(self.reasons)

    def record(self) -> dict[str, Any]:
        """The settings as written to OUT (gqakit_convert.json, the card, GGUF metadata and the
        resume fingerprint): as asked, with the grouping resolved; for a method with options, the
        effort, the values "auto" chose (after the given options) and the reasons, so the record
        states every setting that shaped the result."""
        out = {**self.asked.record(), "grouping": self.grouping}
        if self.kv_heads is not None or self.uniform_kv_heads is not None:
            out["kv_heads"] = list(self.kv_heads) if self.kv_heads is not None else None
            out["num_kv_heads"] = self.num_kv_heads if self.kv_heads is None else None
        if self.output == "gguf":
            out["max_shard_size"] = "-"  # one file
        if self.spec.options is None:
            return out
        given = self.options.given()
        chosen = {k: getattr(self.options, k) for k in self.reasons if k in type(self.options).model_fields}
        return {**out, "effort": self.effort, "options": {**given, **chosen}, "auto": dict(self.reasons)}


def resolve_settings(settings: ConvertSettings, *, source_params: int, max_positions: int | None,
                     output: Output = "folder", device: Device | None = None, hidden: int | None = None,
                     layers: int | None = None, kv_heads: tuple[int, ...] | None = None) -> ResolvedSettings:
    """`settings` with every "auto" decided for a model of `source_params` parameters, a
    context of `max_positions` (None: unknown), `hidden` wide and `layers` deep, written as
    `output`, computed on `device` (None: the CPU, its memory not measured, so that resolving
    imports no torch; `make_plan` gives `device_facts`), with `kv_heads` per layer (None:
    `settings.num_kv_heads` everywhere; a uniform list is normalised): the method's resolver
    (`core.methods.MethodSpec.resolver`) decides its options and the grouping; a method without
    one groups contiguously (the paper)."""
    spec = method_spec(settings.method)
    if output == "folder" and settings.max_shard_size is None:
        raise GqakitError("a model folder OUT needs a largest shard size (--max-shard-size)")
    grouping, options, reasons = settings.grouping, settings.refit, {}
    if spec.resolver is not None:
        grouping, options, reasons = load(spec.resolver)(
            settings, source_params=source_params, max_positions=max_positions, output=output,
            device=device, hidden=hidden, layers=layers)
    if grouping == "auto":
        grouping = "contiguous"
    uniform = kv_heads[0] if kv_heads is not None and len(set(kv_heads)) == 1 else None
    return ResolvedSettings(settings, grouping, options, output, None if settings.dtype == "auto" else settings.dtype,
                            parse_size(settings.max_shard_size) if output == "folder" and settings.max_shard_size
                            is not None else None, reasons, None if uniform is not None else kv_heads, uniform)
