"""The exact allocation of KV heads to layers under a cache budget: a pure function, no torch.

Each layer has candidates (G, bytes per token, damage). The plan takes one candidate per
layer so that the total bytes are within the budget and the total damage is smallest: a
multiple-choice knapsack, solved exactly by dynamic programming over the total cost. The
model is additive: the damage of a plan is the sum of each layer's damage measured alone
(`damage.py`); layers that interact are not modelled.

Sums are exact (`fractions.Fraction` of each float), so the optimum and its tie-breaking do
not depend on the order of additions: among plans of equal total damage the one with fewer
bytes wins, then the one with more heads in the earlier layers. `brute_force` is the same
rule by enumeration, for the tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from gqakit.core.errors import GqakitError


@dataclass(frozen=True)
class Candidate:
    """One way to convert one layer: G KV heads, the bytes per token they cache, and the
    damage of converting that layer alone (0 for the source's own heads)."""

    heads: int
    cost: int
    damage: float


Layers = Sequence[Sequence[Candidate]]


class BudgetTooSmall(GqakitError):
    """The budget is below the smallest cache any plan can have."""


def _key(damage: Fraction, cost: int, heads: tuple[int, ...]) -> tuple[Fraction, int, tuple[int, ...]]:
    return damage, cost, tuple(-h for h in heads)


def minimum_cost(layers: Layers) -> int:
    return sum(min(c.cost for c in cands) for cands in layers)


def _check(layers: Layers, budget: int) -> None:
    if not layers or any(not cands for cands in layers):
        raise GqakitError("no layer to allocate KV heads to")
    if budget < minimum_cost(layers):
        raise BudgetTooSmall(f"the KV budget of {budget:,} bytes per token is below the smallest possible cache, "
                             f"{minimum_cost(layers):,} bytes per token (one KV head in every layer)")


def allocate(layers: Layers, budget: int, *, fixed: dict[int, int] | None = None) -> tuple[int, ...]:
    """The index of the chosen candidate of each layer: the smallest total damage with the total
    cost <= `budget` (ties as the module says). `fixed`: layer -> candidate index, forced.
    Raises `BudgetTooSmall` (one line, naming the minimum) when no plan fits."""
    _check(layers, budget)
    unit = math.gcd(*(c.cost for cands in layers for c in cands)) or 1
    cap = budget // unit
    # cost (in units) -> (exact damage, chosen indices, heads) of the best prefix plan with that cost
    best: dict[int, tuple[Fraction, tuple[int, ...], tuple[int, ...]]] = {0: (Fraction(0), (), ())}
    for li, cands in enumerate(layers):
        nxt: dict[int, tuple[Fraction, tuple[int, ...], tuple[int, ...]]] = {}
        allowed = [fixed[li]] if fixed and li in fixed else range(len(cands))
        for c, (dmg, picks, heads) in best.items():
            for i in allowed:
                cand = cands[i]
                cc = c + cand.cost // unit
                if cc > cap:
                    continue
                new = (dmg + Fraction(cand.damage), picks + (i,), heads + (cand.heads,))
                old = nxt.get(cc)
                if old is None or _key(new[0], cc, new[2]) < _key(old[0], cc, old[2]):
                    nxt[cc] = new
        best = nxt
    if not best:
        raise BudgetTooSmall(f"no plan with the forced candidates fits the KV budget of {budget:,} bytes per token")
    cost = min(best, key=lambda c: _key(best[c][0], c, best[c][2]))
    return best[cost][1]


def brute_force(layers: Layers, budget: int) -> tuple[int, ...]:
    """`allocate` by enumerating every plan (exponential: for tests on small instances)."""
    _check(layers, budget)
    plans = [p for p in itertools.product(*(range(len(c)) for c in layers))
             if sum(layers[i][j].cost for i, j in enumerate(p)) <= budget]
    return min(plans, key=lambda p: _key(sum((Fraction(layers[i][j].damage) for i, j in enumerate(p)), Fraction(0)),
                                         sum(layers[i][j].cost for i, j in enumerate(p)),
                                         tuple(layers[i][j].heads for i, j in enumerate(p))))


def total_damage(layers: Layers, picks: Sequence[int]) -> float:
    return float(sum((Fraction(layers[i][j].damage) for i, j in enumerate(picks)), Fraction(0)))


def reasons(layers: Layers, budget: int, picks: Sequence[int]) -> list[str]:
    """Why each layer got its G: what each other candidate of that layer would do to the best
    total damage within the budget (the plan re-solved with that candidate forced)."""
    best = Fraction(total_damage(layers, picks))
    out = []
    for li, cands in enumerate(layers):
        chosen = cands[picks[li]]
        alts = []
        for i, cand in enumerate(cands):
            if i == picks[li]:
                continue
            try:
                forced = allocate(layers, budget, fixed={li: i})
            except BudgetTooSmall:
                alts.append(f"G={cand.heads} does not fit the budget")
                continue
            delta = float(Fraction(total_damage(layers, forced)) - best)
            alts.append(f"G={cand.heads} raises the total damage by {delta:+.4g}")
        lead = ("kept every head" if chosen.heads == max(c.heads for c in cands)
                else f"G={chosen.heads}, the smallest total damage within the budget")
        out.append(lead + ("" if not alts else ": " + "; ".join(alts)))
    return out
