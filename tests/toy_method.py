"""A conversion method that exists only in the tests, added through the public seam alone
(`register_method`): "toy-first-k" keeps the first K/V head of each (contiguous) group and
changes only K and V. Nothing else in gqakit knows its name."""

from __future__ import annotations

from gqakit.core.methods import METHODS, MethodSpec, register_method

NAME = "toy-first-k"


def toy_first_k(heads, ctx):
    """Toy: keep each contiguous group's first K/V head."""
    keep = [g[0] for g in ctx.groups]
    assert keep == [i * (heads.num_kv_heads // ctx.num_kv_heads) for i in range(ctx.num_kv_heads)], \
        "toy-first-k is written for contiguous groups"
    pick = lambda t: None if t is None else t[keep]  # noqa: E731
    return heads.replace(k=pick(heads.k), v=pick(heads.v), k_bias=pick(heads.k_bias), v_bias=pick(heads.v_bias))


SPEC = MethodSpec(NAME, changes=("k", "v"), fn=toy_first_k)


def register() -> MethodSpec:
    return register_method(SPEC)


def unregister() -> None:
    METHODS.pop(NAME, None)
