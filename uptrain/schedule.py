"""The learning-rate schedule of a run: its length in optimizer steps, the warm-up, the lr per step.

A run of `total` optimizer steps warms up linearly for `warmup` steps, reaches `train.lr`
at step `warmup` and then decays along a cosine to `train.lr * train.min_lr_ratio` at the
last step (nanoGPT's schedule), or stays at `train.lr` with `train.decay: constant`.

A warm-up as long as the run or longer (a recipe's `warmup_steps` kept under a smaller
`train.tokens`) would never reach the peak and never start the decay. `resolve_warmup`
then scales it to a tenth of the run and says so in one line: the run still has the shape
the recipe describes, and nothing changes silently.
"""

from __future__ import annotations

import math
from typing import Any

from gqakit.core.errors import GqakitError

SCALED_WARMUP = 0.1  # the warm-up's share of a run that a too-long `train.warmup_steps` is cut to


def total_steps(train: Any, tokens_per_step: int) -> int:
    """Optimizer steps in the budget; fewer than one is a one-line error."""
    steps = train.budget() // tokens_per_step
    if steps < 1:
        raise GqakitError(f"train.tokens: {train.budget()} is less than one optimizer step ({tokens_per_step} tokens)")
    return steps


def resolve_warmup(train: Any, total: int) -> tuple[int, str | None]:
    """The warm-up steps of a run of TOTAL steps, and a line to print when `train.warmup_steps`
    was too long and has been scaled (else None)."""
    if train.warmup_steps is None:
        return int(train.warmup_ratio * total), None
    if train.warmup_steps < total:
        return train.warmup_steps, None
    warmup = int(SCALED_WARMUP * total)
    return warmup, (f"train.warmup_steps {train.warmup_steps} is not shorter than the run's {total} optimizer steps; "
                    + (f"warming up for {steps(warmup)} ({SCALED_WARMUP:.0%}) instead" if warmup
                       else f"starting at the peak instead (a warm-up of {SCALED_WARMUP:.0%} is under one step)")
                    + f", so the lr reaches {train.lr:g}"
                    + (" and the cosine decay runs" if train.decay == "cosine" else ""))


def steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def lr_at(step: int, train: Any, total: int, warmup: int) -> float:
    """The lr of optimizer step STEP (0-based): linear warm-up, then cosine decay to
    lr * min_lr_ratio (nanoGPT's schedule)."""
    if step < warmup:
        return train.lr * (step + 1) / (warmup + 1)
    if train.decay == "constant" or total <= warmup:
        return train.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return train.lr * (train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
