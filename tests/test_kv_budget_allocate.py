"""`--kv-budget`'s pure parts: the exact allocation (against enumeration, ties and infeasible
budgets included), the budget's spelling, and the settings' one-line refusals."""

from __future__ import annotations

import random

import pytest

from gqakit.convert.budget.allocate import BudgetTooSmall, Candidate, allocate, brute_force, reasons, total_damage
from gqakit.convert.budget.kvbudget import KvBudget
from gqakit.core.errors import GqakitError


def instance(rng: random.Random, *, ties: bool) -> list[list[Candidate]]:
    layers = []
    for _ in range(rng.randint(1, 5)):
        kv = rng.choice([1, 2, 4, 6, 8])
        heads = [g for g in range(kv, 0, -1) if kv % g == 0]
        # ties: damages from a few values (equal totals are common); else any float, negatives too
        dmg = (lambda: rng.choice([0.0, 0.5, 1.0])) if ties else (lambda: rng.uniform(-0.05, 1.0))
        layers.append([Candidate(g, g * 64, 0.0 if g == kv else dmg()) for g in heads])
    return layers


@pytest.mark.parametrize("ties", [False, True])
def test_allocation_equals_enumeration(ties):
    rng = random.Random(1 + ties)
    checked = infeasible = 0
    for _ in range(300):
        layers = instance(rng, ties=ties)
        lo = sum(min(c.cost for c in cands) for cands in layers)
        hi = sum(max(c.cost for c in cands) for cands in layers)
        budget = rng.randint(lo - 64, hi + 64)
        if budget < lo:
            with pytest.raises(BudgetTooSmall, match=f"{lo:,} bytes per token"):
                allocate(layers, budget)
            with pytest.raises(BudgetTooSmall):
                brute_force(layers, budget)
            infeasible += 1
            continue
        picks = allocate(layers, budget)
        assert picks == brute_force(layers, budget)
        assert sum(layers[i][j].cost for i, j in enumerate(picks)) <= budget
        checked += 1
    assert checked > 150 and infeasible > 5


def test_ties_prefer_fewer_bytes_then_earlier_heads():
    free = [Candidate(2, 128, 0.0), Candidate(1, 64, 0.0)]  # pooling costs nothing: fewer bytes win
    assert allocate([free, free], 256) == (1, 1)
    same = [Candidate(2, 128, 0.0), Candidate(1, 64, 1.0)]  # equal total damage and bytes: the earlier layer keeps
    assert allocate([same, same], 192) == (0, 1)


def test_the_allocation_beats_a_greedy_choice():
    # layer 0 saves the most per unit of damage at first, but the exact optimum spends elsewhere
    layers = [[Candidate(4, 4, 0.0), Candidate(2, 2, 0.1), Candidate(1, 1, 10.0)],
              [Candidate(4, 4, 0.0), Candidate(2, 2, 0.3), Candidate(1, 1, 0.35)]]
    picks = allocate(layers, 4)
    assert [layers[i][j].heads for i, j in enumerate(picks)] == [2, 2]
    assert total_damage(layers, picks) == pytest.approx(0.4)
    why = reasons(layers, 4, picks)
    assert "G=4 does not fit the budget" in why[0] and "G=1 raises the total damage by +9.9" in why[0]  # 10 + 0.3 - 0.4


@pytest.mark.parametrize(("text", "fraction", "nbytes"), [
    ("0.25", "1/4", None), ("1/3", "1/3", None), ("1", "1", None), ("12KiB", None, 12288), ("3072B", None, 3072)])
def test_budget_spellings(text, fraction, nbytes):
    b = KvBudget.parse(text)
    assert (b.fraction, b.bytes) == (fraction, nbytes)
    assert b.bytes_of(9000) == (nbytes if nbytes is not None else int(9000 * eval(fraction)))


@pytest.mark.parametrize("text", ["0", "1.5", "3072", "-1", "half", "0KiB", "1/0"])
def test_bad_budgets_are_one_line(text):
    with pytest.raises(GqakitError, match="--kv-budget") as e:
        KvBudget.parse(text)
    assert "\n" not in str(e.value)


def test_settings_take_g_or_a_budget(tmp_path):
    from gqakit.convert.settings import ConvertSettings

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(GqakitError, match="give one"):
        ConvertSettings(source=tmp_path, num_kv_heads=2, kv_budget="0.5")
    with pytest.raises(GqakitError, match="give -g G"):
        ConvertSettings(source=tmp_path)
    s = ConvertSettings(source=tmp_path, kv_budget="1/3")
    assert s.record()["kv_budget"] == "1/3" and s.num_kv_heads is None
