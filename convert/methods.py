"""Conversion methods, by name: one explicit table, `METHODS`.

Each entry is a `MethodSpec`: the per-layer function (None for a method that calibrates
on data), whether it needs calibration data, and whether it touches only K and V.

  mean, first, random   the paper's pooling and its ablations (pooling.py)
  align                 RoPE-aware alignment of each group's heads, then mean (no data)
  align-scale           align, then per-query-head least-squares restoration of the
                        logit scale/phase (RoPE-commuting) and of the value scale (no data)
  align-refit           calibrated: input-weighted alignment, query refit and o_proj
                        ridge refit against the original residual stream, layer by layer
                        (--calibration-data, or text sampled from the source model)

A method that needs data has no per-layer function: the pipeline runs the calibration
stage (`calibration.CalibrationStage`, with the method's fit from `calibration.fits.FITS`) for it,
one decoder block at a time. Every method first
reorders heads into `ctx.groups` (a grouping, `grouping.py`), which preserves the function.
To add a method: write `fn(heads, ctx) -> heads` and add one `MethodSpec` line here.
"""

from __future__ import annotations

from dataclasses import dataclass

from gqakit.convert import align as A
from gqakit.convert.layout import AttnHeads
from gqakit.convert.pooling import (Method, PoolContext, first_method, mean_method, pool_contiguous, random_method,
                                    regroup)
from gqakit.core.errors import GqakitError


def align_transform(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """Regroup and align, without pooling: the same function as `h`, with KV heads kept."""
    return A.align_heads(regroup(h, ctx.groups), ctx.num_kv_heads, rotary_style=ctx.rotary_style,
                         rotary_dim=ctx.rotary_dim)


def align_method(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """RoPE-aware alignment (Q/K per-frequency rotations, V/O orthogonal), then mean pooling."""
    return pool_contiguous(align_transform(h, ctx), ctx.num_kv_heads, "mean")


def align_scale_method(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """align, then restore each query head's logit scale and phase and each value's scale
    by least squares on the weights (no data)."""
    al = align_transform(h, ctx)
    pooled = pool_contiguous(al, ctx.num_kv_heads, "mean")
    pooled = A.refit_queries(al, pooled, rotary_style=ctx.rotary_style, rotary_dim=ctx.rotary_dim, ridge=0.0)
    return A.refit_outputs_local(al, pooled, ridge=0.0)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    fn: Method | None  # the per-layer conversion; None: computed by the calibration stage
    needs_data: bool   # calibrates on text, through the model, one decoder block at a time
    kv_only: bool      # reads and writes only K and V: q and o can be copied through as raw bytes

    def __post_init__(self) -> None:
        if (self.fn is None) != self.needs_data:
            raise ValueError(f"method {self.name}: a per-layer function exactly when it needs no data")


METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec("mean", mean_method, needs_data=False, kv_only=True),
    MethodSpec("first", first_method, needs_data=False, kv_only=True),
    MethodSpec("random", random_method, needs_data=False, kv_only=True),
    MethodSpec("align", align_method, needs_data=False, kv_only=False),
    MethodSpec("align-scale", align_scale_method, needs_data=False, kv_only=False),
    MethodSpec("align-refit", None, needs_data=True, kv_only=False),
)}


def method_spec(name: str) -> MethodSpec:
    """The named method, or a one-line error listing them."""
    if name not in METHODS:
        raise GqakitError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]
