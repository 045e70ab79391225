"""The conversion methods, by name: `METHODS`, a table that imports no torch.

Each entry is a `MethodSpec` and holds everything gqakit knows about a method:

  name        what `--method` says
  changes     the attention projections whose values the method changes ("q", "k", "v", "o"):
              the conversion record lists them per attention (`changed_projections`), and
              LoRA uptraining puts its default adapters there
  needs_data  whether it calibrates on text, through the model, one decoder block at a time
  fn          the per-layer function `fn(heads, ctx) -> heads` (a method that needs no data)
  fit         the calibration stage's `Fit` factory `fit(settings, plan, dtype, device)` (one
              that needs data)
  options     its options model (`--refit-option KEY=VALUE`; a pydantic model with `parse`
              and `given`), or None when it takes none
  resolver    what its "auto" settings become for a model: `resolver(settings, geometry) ->
              (grouping, options, reasons)`; None: the grouping "auto" is contiguous

`fn`, `fit`, `options` and `resolver` are the objects themselves or dotted paths
("package.module:name") imported on first use (`load`), so that reading the table (the
settings check, uptrain's default LoRA targets) imports none of the math.

  mean, first, random   the paper's pooling and its ablations (convert/pooling.py)
  align                 RoPE-aware alignment of each group's heads, then mean (no data)
  align-scale           align, then per-query-head least-squares restoration of the
                        logit scale/phase (RoPE-commuting) and of the value scale (no data)
  align-refit           calibrated: input-weighted alignment, query refit and o_proj
                        ridge refit against the original residual stream, layer by layer

A new method is one `register_method(MethodSpec(...))` call (docs/design.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gqakit.core.errors import GqakitError

ROLES = ("q", "k", "v", "o")
Ref = str | Callable[..., Any] | type | None


@dataclass(frozen=True)
class MethodSpec:
    name: str
    changes: tuple[str, ...]  # the projections whose values it changes, in ROLES order
    needs_data: bool = False
    fn: Ref = None
    fit: Ref = None
    options: Ref = None
    resolver: Ref = None

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"method name {self.name!r}: one word, no spaces")
        if not self.changes or set(self.changes) - set(ROLES):
            raise ValueError(f"method {self.name}: changes must name some of {', '.join(ROLES)}, got {self.changes}")
        if (self.fn is None) != self.needs_data:
            raise ValueError(f"method {self.name}: a per-layer function exactly when it needs no data")
        if self.needs_data and self.fit is None:
            raise ValueError(f"method {self.name}: a method that needs data names its calibration fit")

    @property
    def kv_only(self) -> bool:
        """Whether it changes only K and V: q and o can be copied through as raw bytes."""
        return set(self.changes) <= {"k", "v"}


def load(ref: Ref) -> Any:
    """The object a table entry names: itself, or the attribute a "module:name" path names."""
    if not isinstance(ref, str):
        return ref
    module, _, name = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


_REFIT = "gqakit.convert.refit_options"
METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec("mean", ("k", "v"), fn="gqakit.convert.pooling:mean_method"),
    MethodSpec("first", ("k", "v"), fn="gqakit.convert.pooling:first_method"),
    MethodSpec("random", ("k", "v"), fn="gqakit.convert.pooling:random_method"),
    MethodSpec("align", ROLES, fn="gqakit.convert.methods:align_method"),
    MethodSpec("align-scale", ROLES, fn="gqakit.convert.methods:align_scale_method"),
    MethodSpec("align-refit", ROLES, needs_data=True, fit="gqakit.convert.calibration.fits:align_refit_fit",
               options=f"{_REFIT}:RefitOptions", resolver=f"{_REFIT}:resolve_align_refit"),
)}


def register_method(spec: MethodSpec, *, replace: bool = False) -> MethodSpec:
    """Add `spec` to the table (`--method NAME`, `ConvertSettings(method=...)`); a name already
    there is refused unless `replace`."""
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"register_method takes a MethodSpec, got {type(spec).__name__}")
    if spec.name in METHODS and not replace:
        raise GqakitError(f"method {spec.name!r} is already registered")
    METHODS[spec.name] = spec
    return spec


GROUPING_NAMES = ("contiguous", "similarity")  # `convert.grouping.GROUPINGS`' names, known without torch


def method_spec(name: str) -> MethodSpec:
    """The named method, or a one-line error listing them."""
    if name not in METHODS:
        raise GqakitError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]


def changed_projections(attention: Any, changes: tuple[str, ...] | list[str]) -> list[str]:
    """The projection names of one attention (a `core.arch.Attention`) whose values a method
    with these `changes` rewrote: a fused QKV weight changes when any of q, k, v does."""
    if attention.layout == "separate":
        names = [getattr(attention, r) for r in ROLES if r in changes and r != "o"]
    else:
        names = [attention.qkv] if set(changes) & {"q", "k", "v"} else []
    return names + ([attention.o] if "o" in changes else [])
