"""The per-layer functions of the methods that need no data: `align`, `align-scale` (the
pooling methods mean, first, random are in `pooling`).

The table of methods is `core.methods.METHODS` (re-exported here with `MethodSpec`,
`method_spec`, `register_method` and `method_function`): it names these functions by dotted path, so
that reading it imports no torch. A method that needs data has no per-layer function: the
pipeline runs the calibration stage (`calibration.CalibrationStage`, with the method's `fit`)
for it, one decoder block at a time. Every method first reorders heads into `ctx.groups`
(a grouping, `grouping.py`), which preserves the function.
"""

from __future__ import annotations

from torch import Tensor

from gqakit.convert import align as A
from gqakit.convert.layout import AttnHeads
from gqakit.convert.pooling import Method, PoolContext, pool_contiguous, regroup
from gqakit.core.methods import METHODS, MethodSpec, load, method_spec, register_method

__all__ = ["METHODS", "MethodSpec", "align_method", "aligned_mean", "align_scale_method", "align_transform", "method_function",
           "method_spec", "register_method"]


def align_transform(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """Regroup and align, without pooling: the same function as `h`, with KV heads kept."""
    return A.align_heads(regroup(h, ctx.groups), ctx.num_kv_heads, rotary_style=ctx.rotary_style,
                         rotary_dim=ctx.rotary_dim)


def aligned_mean(h: AttnHeads, G: int, *, rotary_style: str, rotary_dim: int, whiten: Tensor | None = None,
                 s_ab: Tensor | None = None, s_bb: Tensor | None = None, q_ridge: float | None = None) -> AttnHeads:
    """Heads whose groups are contiguous aligned in the metric `whiten` (None: the weights'),
    mean pooled to G, then (with `q_ridge`) each query refitted by ridge least squares on the
    activation moments `s_ab`, `s_bb` (None: the weights'): align-refit's closed-form heads."""
    al = A.align_heads(h, G, rotary_style=rotary_style, rotary_dim=rotary_dim, whiten=whiten)
    pooled = pool_contiguous(al, G, "mean")
    if q_ridge is None:
        return pooled
    return A.refit_queries(al, pooled, rotary_style=rotary_style, rotary_dim=rotary_dim, s_ab=s_ab, s_bb=s_bb,
                           ridge=q_ridge)


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


def method_function(name: str) -> Method:
    """The per-layer function of the method `name` (one that needs no data)."""
    spec = method_spec(name)
    assert spec.fn is not None, f"method {name} calibrates: the calibration stage makes its layers"
    return load(spec.fn)
