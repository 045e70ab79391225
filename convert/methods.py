"""Conversion methods and head groupings, by name.

`METHODS` (pooling.py) holds the paper's per-layer methods; this module adds the methods
beyond the paper, the groupings, and `PREPARE`: whole-model steps (e.g. calibration)
that run once before the per-layer pass and hand their results to every layer through
`PoolContext.extras`.

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
    """Calibrated: the layer's heads computed by `calibrate.prepare_refit`."""
    layers = ctx.extras.get("layers")
    if layers is None or ctx.layer not in layers:
        raise GqakitError("method align-refit needs its calibration pass; use convert_checkpoint or the CLI")
    return layers[ctx.layer]


def _prepare_refit(opened: Any, plan: Any, settings: Any) -> dict[str, Any]:
    from gqakit.convert.calibrate import prepare_refit

    return prepare_refit(opened, plan, settings)


METHODS.update({
    "align": align_method,
    "align-scale": align_scale_method,
    "align-refit": align_refit_method,
})

PREPARE: dict[str, Callable[..., dict[str, Any]]] = {
    "align-refit": _prepare_refit,
}


def all_methods() -> dict[str, Method]:
    return dict(METHODS)
