"""The dry run's probe: the calibration stage itself on the first block, a few spans and steps,
each progress unit timed (`estimate.Rates`), and the line that says the expected time."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from gqakit.convert.calibration.estimate import (PROBE_SPANS, PROBE_STEPS, PROBE_STEPS_SMALL, Rates, duration,
                                                 expected_seconds, rates_from_ticks, run_shape)
from gqakit.convert.calibration.refit import check_steps
from gqakit.convert.calibration.stage import CalibrationStage, pass_size
from gqakit.convert.plan import Plan
from gqakit.convert.refit_options import SMALL_MODEL
from gqakit.convert.resolved import ResolvedSettings


def probe(opened: Any, plan: Plan, settings: ResolvedSettings, *, device: str,
          clock: Callable[[], float] = time.perf_counter) -> Rates:
    """Run the first block of the calibration on `probe_spans` spans with `probe_steps` steps
    (none when the run takes none) and time it."""
    opts = settings.options
    steps = probe_steps(plan) if run_shape(plan, settings)["steps"] else 0
    tokens = probe_spans(plan, settings) * int(opts.batch) * _seq_len(plan, settings)
    small = dataclasses.replace(settings, asked=settings.asked.model_copy(update={"calibration_tokens": tokens}),
                                options=_with(opts, steps=steps, save_seconds=1e9, patience=0))
    if settings.kv_heads is not None:  # a per-layer plan: the first block is timed as a layer that pools
        small = dataclasses.replace(small, kv_heads=None, uniform_kv_heads=min(settings.kv_heads))
    stage = CalibrationStage(opened, plan, small, device=device, progress=False)
    stage.ticks, stage.clock = [], clock
    layers = stage.layers()
    try:
        next(layers)
    finally:
        layers.close()
    spans = len(stage.spans)
    return rates_from_ticks(stage.ticks, spans=spans, steps=steps, guard_spans=int(opts.guard_spans),
                            prepare_seconds=stage.prepare_seconds, sampled=settings.calibration_data is None,
                            checks=len(check_steps(steps, int(opts.guard_checks))),
                            final=bool(steps) and opts.refits_o_after_steps,
                            group=stage.group)


def probe_steps(plan: Plan) -> int:
    """The steps the probe times: `PROBE_STEPS`, or `PROBE_STEPS_SMALL` for a model under 20M parameters."""
    return PROBE_STEPS_SMALL if plan.source_params < SMALL_MODEL else PROBE_STEPS


def probe_spans(plan: Plan, settings: ResolvedSettings) -> int:
    """The spans the probe calibrates on: `PROBE_SPANS` of the passes' groups (the first of each
    pass also reads the block, the others time the passes alone)."""
    return PROBE_SPANS * pass_size(int(settings.options.batch), _seq_len(plan, settings))


def _seq_len(plan: Plan, settings: ResolvedSettings) -> int:
    """The calibration's sequence length: the asked one, within the model's positions."""
    n = int(settings.options.seq_len)
    return min(n, plan.shape.max_positions or n)


def _with(opts: Any, **update: Any) -> Any:
    new = opts.model_copy(update=update)
    new._given = opts._given
    return new


def estimate_line(opened: Any, plan: Plan, settings: ResolvedSettings, *, device: str) -> str:
    """The dry run's line: the expected calibration time, from a probe on this device."""
    rates = probe(opened, plan, settings, device=device)
    shape = run_shape(plan, settings)
    total = expected_seconds(rates, **shape)
    per_layer = rates.per_layer(shape["spans"], shape["steps"], shape["guard_spans"], shape["guard_checks"])
    each = "each" if shape["trained"] == shape["layers"] else f"in each of {shape['trained']} layers"
    spans = probe_spans(plan, settings)
    return (f"expected time: about {duration(total)} for the calibration on {device} ({duration(per_layer)} per "
            f"layer x {shape['layers']} layers, {shape['steps']} steps {each}; from a probe of the first layer on "
            f"{spans} spans" + (f" and {probe_steps(plan)} steps)" if shape["steps"] else ")"))
