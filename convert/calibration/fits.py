"""The calibration fits of the built-in methods that need data.

A method that needs data (`core.methods.MethodSpec.needs_data`) is fitted by the calibration
stage one block at a time; its entry's `fit` names a factory `fit(settings, plan, dtype,
device) -> block.Fit` (this module's `align_refit_fit` for align-refit). To add one: write the
fit (as `refit.AlignRefit` is written) and name its factory in the method's entry. The stage
does not change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gqakit.convert.calibration.block import Fit
from gqakit.convert.calibration.refit import AlignRefit
from gqakit.convert.plan import Plan, layer_kv_pairs
from gqakit.convert.resolved import ResolvedSettings
from gqakit.core.methods import load

FitFactory = Callable[[ResolvedSettings, Plan, torch.dtype, str], Fit]


def align_refit_fit(settings: ResolvedSettings, plan: Plan, dtype: torch.dtype, device: str) -> Fit:
    """align-refit's fit: input-weighted alignment, query refit, o_proj refit, reconstruction."""
    return AlignRefit(settings.options, grouping=settings.grouping, seed=settings.seed,
                      kv=layer_kv_pairs(plan, settings),
                      dtype=dtype, device=device)


def fit_for(settings: ResolvedSettings, plan: Plan, *, dtype: torch.dtype, device: str) -> Fit:
    """The fit of `settings.method` (its entry's `fit`), computing in `dtype` on `device`."""
    factory: FitFactory = load(settings.spec.fit)
    return factory(settings, plan, dtype, device)
