"""Which fit calibrates which method: one line per calibrated method.

A method that needs data (`methods.MethodSpec.needs_data`) is fitted by the calibration
stage one block at a time; its fit is a `block.Fit`. To add one: write the fit (as
`refit.AlignRefit` is written) and add its line to `FITS`. The stage does not change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gqakit.convert.calibration.block import Fit
from gqakit.convert.calibration.refit import AlignRefit
from gqakit.convert.plan import Plan
from gqakit.convert.settings import ConvertSettings

FitFactory = Callable[[ConvertSettings, Plan, torch.dtype, str], Fit]

FITS: dict[str, FitFactory] = {
    "align-refit": lambda settings, plan, dtype, device: AlignRefit(
        settings.refit, grouping=settings.grouping, seed=settings.seed, kv_from=plan.shape.num_kv_heads,
        kv_to=settings.num_kv_heads, dtype=dtype, device=device),
}


def fit_for(settings: ConvertSettings, plan: Plan, *, dtype: torch.dtype, device: str) -> Fit:
    """The fit of `settings.method`, computing in `dtype` on `device`."""
    return FITS[settings.method](settings, plan, dtype, device)
