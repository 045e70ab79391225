"""Conversion methods and head groupings, by name.

`METHODS` (pooling.py) holds the paper's per-layer methods; this module adds the methods
beyond the paper, the groupings, and `STAGES`: methods that calibrate on data and so
run as a stage over the whole model, one decoder block at a time, instead of one layer's
weights at a time.

Methods (each reorders heads into `ctx.groups` first, which preserves the function):
  mean, first, random   the paper's pooling and its ablations (pooling.py)
  align                 RoPE-aware alignment of each group's heads, then mean (no data)
  align-scale           align, then per-query-head least-squares restoration of the
                        logit scale/phase (RoPE-commuting) and of the value scale (no data)
  align-refit           calibrated: input-weighted alignment, query refit and o_proj
                        ridge refit against the original residual stream, layer by layer
                        (--calibration-data, or text sampled from the source model)
Groupings:
  contiguous            neighbouring heads share a group (the paper)
  similarity            balanced groups of the most similar heads after alignment
                        (weights; in the input-activation metric under align-refit)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gqakit.convert import align as A
from gqakit.convert.layout import AttnHeads
from gqakit.convert.pooling import METHODS, Groups, Method, PoolContext, regroup
from gqakit.core.errors import GqakitError


# ----------------------------------------------------------------------------- groupings

def _contiguous(h: AttnHeads, ctx: PoolContext) -> Groups:
    return ctx.groups


def similarity_grouping(h: AttnHeads, ctx: PoolContext) -> Groups:
    """Equal-size groups of the KV heads that are closest after alignment.

    Distance: K (RoPE-commuting alignment) plus V (orthogonal alignment), each head
    normalised, in the metric of the layer's input second moment when a calibrated
    method provides one (`ctx.extras["whiten"]`), else of the weights.
    """
    dist = A.head_distance(h, rotary_style=ctx.rotary_style, rotary_dim=ctx.rotary_dim,
                           whiten=ctx.extras.get("whiten"))
    return A.balanced_partition(dist, ctx.num_kv_heads)


GROUPINGS: dict[str, Callable[[AttnHeads, PoolContext], Groups]] = {
    "contiguous": _contiguous,
    "similarity": similarity_grouping,
}


# ----------------------------------------------------------------------------- methods

def align_transform(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """Regroup and align, without pooling: the same function as `h`, with KV heads kept."""
    return A.align_heads(regroup(h, ctx.groups), ctx.num_kv_heads, rotary_style=ctx.rotary_style,
                         rotary_dim=ctx.rotary_dim)


def align_method(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """RoPE-aware alignment (Q/K per-frequency rotations, V/O orthogonal), then mean pooling."""
    return A.pool_mean(align_transform(h, ctx), ctx.num_kv_heads)


def align_scale_method(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """align, then restore each query head's logit scale and phase and each value's scale
    by least squares on the weights (no data)."""
    al = align_transform(h, ctx)
    pooled = A.pool_mean(al, ctx.num_kv_heads)
    pooled = A.refit_queries(al, pooled, rotary_style=ctx.rotary_style, rotary_dim=ctx.rotary_dim, ridge=0.0)
    return A.refit_outputs_local(al, pooled, ridge=0.0)


def align_refit_method(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """Calibrated: computed block by block by `calibrate.RefitStage` (see STAGES), never per layer alone."""
    raise GqakitError("method align-refit needs its calibration pass; use convert_checkpoint or the CLI")


def _refit_stage(opened: Any, plan: Any, settings: Any, **kw: Any) -> Any:
    from gqakit.convert.calibrate import RefitStage

    return RefitStage(opened, plan, settings, **kw)


METHODS.update({
    "align": align_method,
    "align-scale": align_scale_method,
    "align-refit": align_refit_method,
})

# Methods that calibrate on data: a stage object whose `layers()` yields (layer, heads) in
# layer order, one decoder block in memory at a time, and whose `summary` is recorded in OUT.
STAGES: dict[str, Callable[..., Any]] = {
    "align-refit": _refit_stage,
}


def all_methods() -> dict[str, Method]:
    return dict(METHODS)
