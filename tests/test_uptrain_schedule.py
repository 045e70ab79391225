"""The learning-rate schedule: a warm-up too long for the budget is scaled and said, so the
lr reaches its peak and the cosine decay runs."""

from __future__ import annotations

import pytest

from gqakit.core.errors import GqakitError
from gqakit.uptrain.config import load_config
from gqakit.uptrain.schedule import lr_at, resolve_warmup, total_steps

BASE = {"model": {"path": "/m"}, "data": {"texts": ["a b c"]}, "output": {"dir": "/o"},
        "train": {"tokens": 2_000_000, "seq_len": 512, "micro_batch": 2, "lr": 1e-2, "min_lr_ratio": 0.05,
                  "warmup_steps": 20}}


def schedule(overrides: list[str]) -> tuple[list[float], int, str | None, float, float]:
    t = load_config(BASE, overrides).train
    total = total_steps(t, t.micro_batch * t.grad_accum * t.seq_len)
    warmup, note = resolve_warmup(t, total)
    return [lr_at(s, t, total, warmup) for s in range(total)], warmup, note, t.lr, t.lr * t.min_lr_ratio


def test_a_warm_up_longer_than_a_small_budget_is_scaled_and_said():
    # stories260K-g2's schedule with train.tokens=16384: 16 steps of 1,024 tokens, warmup_steps 20
    lrs, warmup, note, peak, floor = schedule(["train.tokens=16384"])
    assert len(lrs) == 16 and warmup == 1
    assert note == ("train.warmup_steps 20 is not shorter than the run's 16 optimizer steps; warming up for 1 step "
                    "(10%) instead, so the lr reaches 0.01 and the cosine decay runs")
    # the peak is reached (the formula gives exactly train.lr at step `warmup`: no rounding beyond
    # one multiplication by 1.0), then the lr falls every step towards lr * min_lr_ratio
    assert max(lrs) == pytest.approx(peak, rel=1e-12) and lrs.index(max(lrs)) == warmup
    after = lrs[warmup:]
    assert all(a > b for a, b in zip(after, after[1:]))
    assert floor < after[-1] < 0.1 * peak  # the cosine ran most of the way down (last step: 1/15 short of the end)


def test_a_warm_up_that_fits_is_kept_and_says_nothing():
    lrs, warmup, note, peak, _ = schedule([])  # 1,953 steps
    assert (warmup, note) == (20, None) and lrs.index(max(lrs)) == 20 and max(lrs) == pytest.approx(peak, rel=1e-12)
    assert lrs[19] < peak
    _, warmup, note, _, _ = schedule(["train.warmup_steps=null", "train.warmup_ratio=0.1"])
    assert (warmup, note) == (195, None)


@pytest.mark.parametrize("tokens, warmup", [(16 * 1024, 16), (17 * 1024, 16), (5 * 1024, 40)])
def test_the_boundary_is_a_warm_up_as_long_as_the_run(tokens: int, warmup: int):
    """warmup_steps >= steps: the peak would come at or after the last step."""
    lrs, got, note, peak, _ = schedule([f"train.tokens={tokens}", f"train.warmup_steps={warmup}"])
    if warmup < len(lrs):
        assert (got, note) == (warmup, None)
    else:
        assert got == len(lrs) // 10 and note is not None
    assert max(lrs) == pytest.approx(peak, rel=1e-12)


def test_constant_decay_and_a_budget_under_one_step():
    lrs, warmup, note, peak, _ = schedule(["train.tokens=8192", "train.decay=constant"])
    assert warmup == 0 and lrs == [peak] * 8 and note.endswith("so the lr reaches 0.01")
    with pytest.raises(GqakitError, match=r"train.tokens: 1000 is less than one optimizer step \(1024 tokens\)"):
        schedule(["train.tokens=1000"])
