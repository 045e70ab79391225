"""Conversion methods and head groupings, by name.

`METHODS` (pooling.py) holds the per-layer methods; this module adds the methods beyond
the paper, the groupings, and `PREPARE`: whole-model steps (e.g. collecting calibration
activations) that run once before the per-layer pass and hand their results to every
layer through `PoolContext.extras`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gqakit.convert.layout import AttnHeads
from gqakit.convert.pooling import METHODS, Groups, Method, PoolContext


def _contiguous(h: AttnHeads, ctx: PoolContext) -> Groups:
    return ctx.groups


GROUPINGS: dict[str, Callable[[AttnHeads, PoolContext], Groups]] = {
    "contiguous": _contiguous,
}

PREPARE: dict[str, Callable[..., dict[str, Any]]] = {}


def all_methods() -> dict[str, Method]:
    return dict(METHODS)
