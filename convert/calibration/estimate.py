"""How long a calibrated conversion will take on this device, from a short measured probe.

`probe.probe` runs the calibration stage itself on the first block, with a few spans of calibration
sequences and a few reconstruction steps, and times each progress unit (`Rates`).
`expected_seconds` scales those rates by what the real run does: per layer, three passes over
every span (the input moments, the o_proj fit with the original stream's advance, the
converted stream's advance), `steps` reconstruction steps and the guard's forwards, plus a
fixed part (reading the block, the closed-form solves); before the first layer, the
calibration tokens and the block inputs: as measured for a file (reading and tokenizing it
dominate), per generate call for text sampled from the model. Nothing is written.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from gqakit.convert.plan import Plan, layer_kv_pairs
from gqakit.convert.resolved import ResolvedSettings

PROBE_SPANS = 3  # passes' groups of spans the probe calibrates on (the first of each pass reads the block too)
PROBE_STEPS = 8  # reconstruction steps it times (a guard check after every other step)
# for a model under 20M parameters, whose steps take milliseconds: 8 of them are too short a sample of
# the machine (a guard check after every eighth)
PROBE_STEPS_SMALL = 32
GUARD_CHECKS = 4  # guard evaluations over a layer's steps by default (`guard_checks`), one more before them


def duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@dataclass(frozen=True)
class Rates:
    """Seconds per unit of a calibrated conversion, measured by `probe` on the first block."""

    fit_span: float     # one span through a fit pass (input moments or the o_proj fit), median
    forward_span: float  # one span through the whole block (the converted stream's advance), median
    step: float         # one reconstruction step (0 without steps), median
    layer_fixed: float  # per layer, outside the units: reading the block, the closed-form solves
    prepare: float      # before the first layer: calibration tokens, the outer modules, block inputs
    sampled: bool       # the calibration text is sampled from the model (`prepare` per generate call)
    final_span: float = 0.0  # one span through o_proj's refit after the steps (`final_o`; 0: not taken)

    def per_layer(self, spans: int, steps: int, guard_spans: int, guard_checks: int = GUARD_CHECKS) -> float:
        """Every step taken (early stopping can only make a layer shorter)."""
        final = bool(steps and self.final_span)
        guard = (1 + min(guard_checks, steps) + final) * min(guard_spans, spans) * self.forward_span if steps else 0.0
        return (self.layer_fixed + spans * (2 * self.fit_span + self.forward_span) + steps * self.step + guard
                + (spans * self.final_span if final else 0.0))


def expected_seconds(rates: Rates, *, layers: int, spans: int, steps: int, guard_spans: int,
                     guard_checks: int = GUARD_CHECKS, generate_calls: int = 1, trained: int | None = None) -> float:
    """The whole calibration's expected seconds: the preparation, then `layers` layers, `trained`
    of them (all by default) with `steps` steps each."""
    # reading and tokenizing a file, loading the embeddings: about fixed; sampling: per generate call
    prepare = rates.prepare * (generate_calls if rates.sampled else 1)
    trained = layers if trained is None else trained
    return (prepare + trained * rates.per_layer(spans, steps, guard_spans, guard_checks)
            + (layers - trained) * rates.per_layer(spans, 0, guard_spans, guard_checks))


def per_span(units: list[float], group: int = 1) -> float:
    """Seconds per span of a pass, from the time of each of its units: the median over its groups
    of `group` spans (run together, their units ticked at once) after the first, which also reads
    the block or solves a fit (`stage.pass_groups`); a partial last group left out."""
    if group > 1:
        units = [sum(units[i:i + group]) / group for i in range(0, len(units) - group + 1, group)] or units
    return statistics.median(units[1:] or units)


def rates_from_ticks(ticks: list[float], *, spans: int, steps: int, guard_spans: int, prepare_seconds: float,
                     sampled: bool, checks: int | None = None, final: bool = False, group: int = 1) -> Rates:
    """`Rates` from the clock at the start of the first layer and after each of its progress units:
    2 x `spans` fit units, `steps` steps, with `final` `spans` units of o_proj's refit after them,
    then `spans` forward units (`stage.CalibrationStage`; the passes take `group` spans at a time);
    `checks`: the guard evaluations among the steps (default: after every other step)."""
    t = ticks
    d = [b - a for a, b in zip(t, t[1:])]
    moments, o_fit = d[:spans], d[spans:2 * spans]
    step = d[2 * spans:2 * spans + steps]
    n_final = spans if final and steps else 0
    after = d[2 * spans + steps:2 * spans + steps + n_final]
    fwd = d[2 * spans + steps + n_final:]
    fit_span = (per_span(moments, group) + per_span(o_fit, group)) / 2
    fwd_span = per_span(fwd, group)
    # a guard check after every other step lands in the next step's interval: the others are steps alone
    step_s = statistics.median(step[1::2] or step) if step else 0.0
    if checks is None:
        checks = sum(1 for i in range(1, steps + 1) if i % max(1, steps // 4) == 0 or i == steps)
    # the guard before the steps, and once more on o_proj's refit after them
    checks = checks + 1 + bool(n_final) if steps else 0
    # the first unit after the last step also takes the guard evaluation after it
    final_span = per_span(after, group) if after else 0.0
    accounted = (spans * (2 * fit_span + fwd_span) + steps * step_s + checks * min(guard_spans, spans) * fwd_span
                 + n_final * final_span)
    return Rates(fit_span, fwd_span, step_s, max(0.0, (t[-1] - t[0]) - accounted), prepare_seconds, sampled,
                 final_span)


def run_shape(plan: Plan, settings: ResolvedSettings) -> dict[str, int]:
    """What the real run does: its layers, spans, steps per layer and how many layers take them, guard
    spans and generate calls."""
    opts = settings.options
    seq_len = min(int(opts.seq_len), plan.shape.max_positions or int(opts.seq_len))
    n_seq = max(1, math.ceil(settings.calibration_tokens / seq_len))
    steps_at = [opts.train_steps(a, b) for a, b in layer_kv_pairs(plan, settings)]  # none where heads are kept
    return {"layers": plan.shape.num_layers, "spans": math.ceil(n_seq / int(opts.batch)),
            "steps": max(steps_at, default=0), "trained": sum(1 for s in steps_at if s),
            "guard_spans": int(opts.guard_spans), "guard_checks": int(opts.guard_checks), "generate_calls": math.ceil(n_seq / int(opts.sample_batch))}


def early_line(ticks: list[float], *, spans: int, steps: int, layers_left: int, elapsed: float,
               kept_left: int = 0, final: bool = False, group: int = 1) -> str:
    """The run's first progress line: the expected time, from its own first layer with steps so far
    (the clock at the layer's start and after its 2 x `spans` fit passes and its first steps), the
    converted stream's pass (and with `final`, o_proj's refit after the steps) counted as a fit pass;
    `layers_left` layers with `steps` steps to go, this one included, and `kept_left` that take none
    (a per-layer plan's kept layers); the passes take `group` spans at a time."""
    d = [b - a for a, b in zip(ticks, ticks[1:])]
    moments, o_fit, step = d[:spans], d[spans:2 * spans], d[2 * spans:]
    fit_span = (per_span(moments, group) + per_span(o_fit, group)) / 2
    step_s = statistics.median(step[1:] or step)
    g = min(group, spans)  # the first group of each pass also reads the block or solves a fit
    fixed = max(0.0, sum(d[:g]) - g * fit_span) + max(0.0, sum(d[spans:spans + g]) - g * fit_span)
    rates = Rates(fit_span, fit_span, step_s, fixed, 0.0, False, fit_span if final else 0.0)
    per_layer = rates.per_layer(spans, steps, 8)  # the default guard
    total = elapsed + per_layer * layers_left + rates.per_layer(spans, 0, 8) * kept_left  # elapsed: before it
    kept = f", and {kept_left} without steps" if kept_left else ""
    return (f"expected time: about {duration(total)} in all ({duration(per_layer)} per layer: {step_s:.3g} s per "
            f"step x {steps} steps, {fit_span:.3g} s per span x {(3 + final) * spans} span passes; measured on the first "
            f"layer's passes and {len(step)} steps; {layers_left} layer{'s' if layers_left != 1 else ''}{kept})")
