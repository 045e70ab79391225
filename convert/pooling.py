"""The conversion math: pure functions on canonical `AttnHeads` (no IO).

A conversion from KV to G key/value heads is:
  1. choose `groups`: G lists of KV-head indices, KV/G each (`grouping.py`; contiguous
     by default, the paper's choice);
  2. `regroup`: reorder KV heads (and the query heads that use them, and o_proj's input
     columns) so each group is contiguous. This leaves the layer's function unchanged;
  3. pool each group of K and V heads into one head: `mean` (the paper), `first`
     (keep the group's first head) or `random` (fresh initialisation, the paper's
     ablation baseline).
Groupings live in `grouping.py`; every method, the paper's and the ones beyond it, is
named in `methods.METHODS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from gqakit.convert.grouping import Groups
from gqakit.convert.layout import AttnHeads


@dataclass
class PoolContext:
    """What a method may need besides the layer's weights."""

    num_kv_heads: int                 # G, the target
    groups: Groups                    # G lists of source KV heads
    rotary_style: str = "none"        # "rotate_half", "interleaved" or "none"
    rotary_dim: int = 0               # leading dims of each head that are rotated
    layer: int = 0
    generator: torch.Generator | None = None


def query_order(groups: Groups, num_heads: int, num_kv_heads: int) -> list[int]:
    """Query heads in the order that makes each group's query heads contiguous."""
    r = num_heads // num_kv_heads
    return [kv * r + i for g in groups for kv in g for i in range(r)]


def regroup(h: AttnHeads, groups: Groups) -> AttnHeads:
    """Reorder heads so that `groups` become contiguous blocks; function-preserving.

    KV heads are permuted into group order, each query head moves with the KV head it
    reads, and o_proj's input columns move with the query heads; `q_order` records where
    each query head came from.
    """
    if [i for g in groups for i in g] == list(range(h.num_kv_heads)):
        return h  # already contiguous: nothing moves
    kv_perm = torch.tensor([i for g in groups for i in g])
    q_perm = torch.tensor(query_order(groups, h.num_heads, h.num_kv_heads))
    pick = lambda t, p: None if t is None else t[p]  # noqa: E731
    before = h.q_order or list(range(h.num_heads))
    return AttnHeads(q=h.q[q_perm], k=h.k[kv_perm], v=h.v[kv_perm], o=h.o[:, q_perm],
                     q_bias=pick(h.q_bias, q_perm), k_bias=pick(h.k_bias, kv_perm), v_bias=pick(h.v_bias, kv_perm),
                     q_norm=pick(h.q_norm, q_perm), k_norm=pick(h.k_norm, kv_perm),
                     q_order=[before[i] for i in q_perm.tolist()])


def _pool(t: Tensor | None, G: int, how: str) -> Tensor | None:
    """[KV, ...] -> [G, ...], over contiguous groups."""
    if t is None:
        return None
    t = t.reshape(G, t.shape[0] // G, *t.shape[1:])
    return t.mean(dim=1) if how == "mean" else t[:, 0]


def pool_contiguous(h: AttnHeads, G: int, how: str = "mean") -> AttnHeads:
    """Pool K and V (weights, biases and a whole-projection k norm's weights) over contiguous
    groups of KV heads."""
    return h.replace(k=_pool(h.k, G, how), v=_pool(h.v, G, how),
                     k_bias=_pool(h.k_bias, G, how), v_bias=_pool(h.v_bias, G, how), k_norm=_pool(h.k_norm, G, how))


def mean_method(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """The GQA paper's recipe: each new K/V head is the mean of its group's heads."""
    return pool_contiguous(regroup(h, ctx.groups), ctx.num_kv_heads, "mean")


def first_method(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """Ablation baseline: keep the first head of each group."""
    return pool_contiguous(regroup(h, ctx.groups), ctx.num_kv_heads, "first")


def random_method(h: AttnHeads, ctx: PoolContext) -> AttnHeads:
    """Ablation baseline: new K/V heads drawn at random, with the original weights' std."""
    h = regroup(h, ctx.groups)
    G = ctx.num_kv_heads

    def fresh(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        new = torch.randn((G, *t.shape[1:]), generator=ctx.generator, dtype=t.dtype)
        return new * t.std()

    return h.replace(k=fresh(h.k), v=fresh(h.v),
                     k_bias=None if h.k_bias is None else torch.zeros_like(h.k_bias[:G]),
                     v_bias=None if h.v_bias is None else torch.zeros_like(h.v_bias[:G]),
                     k_norm=_pool(h.k_norm, G, "mean"))  # a norm's scale, not a projection: kept


Method = Callable[[AttnHeads, PoolContext], AttnHeads]
