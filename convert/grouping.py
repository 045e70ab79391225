"""Which KV heads share a group: the groupings, by name.

A grouping maps one layer's heads to G equal lists of KV-head indices; the methods then
regroup (`pooling.regroup`) and pool them. It imports only the head math (`align`,
`layout`), never the methods, the pipeline or the calibration stage.

  contiguous   neighbouring heads share a group (the paper)
  similarity   balanced groups of the most similar heads after alignment (in the metric
               of the layer input's second moment when the calibration stage gives one,
               else of the weights)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import combinations

from torch import Tensor

from gqakit.convert.align import head_distance
from gqakit.convert.layout import AttnHeads
from gqakit.core.methods import GROUPING_NAMES

Groups = list[list[int]]


def contiguous_groups(num_kv_heads: int, num_groups: int) -> Groups:
    """The paper's grouping: neighbouring heads share a group."""
    r = num_kv_heads // num_groups
    return [list(range(g * r, (g + 1) * r)) for g in range(num_groups)]


def contiguous(h: AttnHeads, num_groups: int, *, rotary_style: str = "none", rotary_dim: int = 0,
               whiten: Tensor | None = None) -> Groups:
    return contiguous_groups(h.num_kv_heads, num_groups)


def similarity(h: AttnHeads, num_groups: int, *, rotary_style: str = "none", rotary_dim: int = 0,
               whiten: Tensor | None = None) -> Groups:
    """Equal-size groups of the KV heads that are closest after alignment.

    Distance: K (RoPE-commuting alignment) plus V (orthogonal alignment), each head
    normalised, in the metric of `whiten` (a factor of the layer input's second moment,
    from calibration data) when given, else of the weights.
    """
    dist = head_distance(h, rotary_style=rotary_style, rotary_dim=rotary_dim, whiten=whiten)
    return balanced_partition(dist, num_groups)


Grouping = Callable[..., Groups]
GROUPINGS: dict[str, Grouping] = {
    "contiguous": contiguous,
    "similarity": similarity,
}
if tuple(GROUPINGS) != GROUPING_NAMES:  # the settings check reads the names there, without torch
    raise RuntimeError(f"core.methods.GROUPING_NAMES {GROUPING_NAMES} must list GROUPINGS {tuple(GROUPINGS)}")


def balanced_partition(dist: Tensor, num_groups: int, max_enumerate: int = 20000) -> list[list[int]]:
    """Equal-size groups minimising the sum of within-group distances.

    Exhaustive when the number of partitions is small, else greedy: each group starts
    from the lowest-numbered free head and adds, one at a time, the free head with the
    smallest summed distance to the heads already in it.
    """
    n = dist.shape[0]
    s = n // num_groups
    if s == 1:
        return [[i] for i in range(n)]
    count = math.factorial(n) // (math.factorial(s) ** num_groups * math.factorial(num_groups))
    d = dist.tolist()

    def cost(groups: list[list[int]]) -> float:
        return sum(d[a][b] for g in groups for i, a in enumerate(g) for b in g[i + 1:])

    if count <= max_enumerate:
        best: tuple[float, list[list[int]]] = (float("inf"), [])

        def rec(free: list[int], acc: list[list[int]]) -> None:
            nonlocal best
            if not free:
                c = cost(acc)
                if c < best[0] - 1e-12:
                    best = (c, [list(g) for g in acc])
                return
            first, rest = free[0], free[1:]
            for comb in combinations(rest, s - 1):
                rec([x for x in rest if x not in comb], acc + [[first, *comb]])

        rec(list(range(n)), [])
        groups = best[1]
    else:
        free = set(range(n))
        groups = []
        while free:
            seed = min(free)
            g = [seed]
            free.discard(seed)
            while len(g) < s:
                nxt = min(free, key=lambda c: sum(d[c][x] for x in g))
                g.append(nxt)
                free.discard(nxt)
            groups.append(g)
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])
