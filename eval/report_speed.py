"""The decode-speed part of `gqakit compare`'s report: every grid point with its spread over
the repetitions, each speedup with the interval those repetitions allow, and the speedup
the roofline predicted.

A speedup is quoted as a finding only when the repetitions separate the two models: its
interval runs from the slowest repetition of this model over the fastest of the baseline
to the fastest over the slowest (the two tokens/s ranges). An interval that holds 1 means
the ranges overlap, and the speedup is reported as within noise. A share of the predicted
speedup outside 0–150% is noise too (a prediction near 1× turns any jitter into thousands
of percent), and so is every share of a speedup within noise.
"""

from __future__ import annotations

from typing import Any

from gqakit.eval.records import UNSET, SpeedPoint, opt
from gqakit.eval.report_rows import GridPoint, Report, SpeedEntry
from gqakit.eval.speed.roofline import StepCost, predict_speedup, share

NOISE = "within noise"
SHARE_RANGE = (0.0, 1.5)  # a share of the predicted speedup outside it is not a finding
NO_TIMING_TOGETHER = ("Each model here was timed in its own run, so the ratios also carry any drift between the "
                      "runs; for ratios measured in one run, time the models together, their decode steps "
                      "alternating (`gqakit demo` does; in Python, `gqakit.eval.speed.evaluate_speed_together`).")


def point_label(axes: dict[str, Any], sep: str = "_") -> str:
    """b8_p1024 (decoder-only), b8_p4096_o1 (encoder-decoder: input 4096, output 1)."""
    return sep.join([f"b{axes['batch']}", f"p{axes['prompt_len']}"]
                    + ([f"o{axes['output_len']}"] if "output_len" in axes else []))


def spread(point: SpeedPoint) -> tuple[float, float] | None:
    """(min, max) tokens/s over a point's repetitions; None for results files that did not record it."""
    t = point.tokens_per_s or {}
    return (t["min"], t["max"]) if "min" in t and "max" in t else None


def speedup_interval(base: SpeedPoint, point: SpeedPoint) -> tuple[float, float] | None:
    """The range of `point`'s speedup over `base` that their repetitions allow: slowest over
    fastest to fastest over slowest; None where either lacks its spread."""
    b, p = spread(base), spread(point)
    if b is None or p is None:
        return None
    return p[0] / b[1], p[1] / b[0]


def share_is_noise(value: float | None, speedup_noise: bool | None) -> bool:
    """A share of the predicted speedup that is no finding: of a speedup within noise, or outside 0–150%."""
    return value is not None and (bool(speedup_noise) or not SHARE_RANGE[0] <= value <= SHARE_RANGE[1])


def predicted_speedup(base: SpeedPoint, point: SpeedPoint, measured: float,
                      noise: bool | None = None) -> dict[str, Any]:
    """What the roofline predicts for `point` against `base` (same batch and prompt), and the share achieved.

    By bytes: the ratio of the bytes a decode step must read (weights + filled KV cache).
    Where either step is compute-bound, also by the roofline: each step at max(bytes /
    copy bandwidth, FLOPs / matmul FLOP/s) of its own run. Results files written before
    these numbers were recorded give nothing. `noise`: the measured speedup is within noise.
    """
    out: dict[str, Any] = {}
    b, p = StepCost.of(base), StepCost.of(point)
    if b is None or p is None:
        return out
    pred = predict_speedup(b, p)
    out["predicted_speedup_bytes"] = pred.bytes
    out["share_of_predicted"] = share(measured, pred.bytes)
    out["share_of_predicted_within_noise"] = share_is_noise(out["share_of_predicted"], noise)
    if pred.compute_bound and b.flops_ms and p.flops_ms and pred.roofline is not None:
        out["predicted_speedup_roofline"] = pred.roofline
        out["share_of_predicted_roofline"] = share(measured, pred.roofline)
        out["share_of_predicted_roofline_within_noise"] = share_is_noise(out["share_of_predicted_roofline"], noise)
    return out


def speed_entry(key: tuple[int, ...], g: SpeedPoint, g0: SpeedPoint | None) -> SpeedEntry:
    """A model's entry at grid point `key`; for an ok point, its tokens/s with the spread, and
    against the baseline's point `g0` the speedup, its interval, whether it is within noise,
    the prediction."""
    entry = SpeedEntry(**GridPoint.of(key).axes, status=g.status)
    if not g.ok:
        return entry
    tps = g.tokens_per_s["median"]
    entry.tokens_per_s, entry.decode_ms_per_token = tps, g.decode_ms_per_token["median"]
    entry.prefill_ms, entry.roofline_fraction = g.prefill_ms["median"], g.roofline_fraction
    entry.memory_bound, entry.kv_cache_bytes = g.memory_bound, opt(g.kv_cache_bytes)
    entry.peak_memory_bytes = opt(g.peak_memory_bytes)
    s = spread(g)
    if s is not None:
        entry.tokens_per_s_min, entry.tokens_per_s_max = s
    if g0 is not None and g0.ok:
        entry.speedup = tps / g0.tokens_per_s["median"]
        iv = speedup_interval(g0, g)
        entry.speedup_interval = None if iv is None else list(iv)
        entry.speedup_within_noise = None if iv is None else iv[0] <= 1 <= iv[1]
        for k, v in predicted_speedup(g0, g, entry.speedup, entry.speedup_within_noise).items():
            setattr(entry, k, v)
    return entry


def speedup_text(e: SpeedEntry | dict[str, Any]) -> str:
    """A measured speedup as the report prints it: '1.84×', 'within noise', or '0.55×, spread not recorded'."""
    e = e if isinstance(e, SpeedEntry) else SpeedEntry.model_validate(e)
    if e.speedup_within_noise:
        return NOISE
    return f"{e.speedup:.2f}×" + (", spread not recorded" if opt(e.speedup_interval) is None else "")


def _pct(v: float | None, noise: bool = False) -> str:
    return "n/a" if v is None else NOISE if noise else f"{100 * v:.0f}%"


def _tps_text(e: SpeedEntry) -> str:
    rng = (f" ({e.tokens_per_s_min:,.1f}–{e.tokens_per_s_max:,.1f})" if e.tokens_per_s_min is not UNSET
           else " (spread not recorded)")
    return f"{e.tokens_per_s:,.1f}{rng}"


def speed_table(report: Report) -> list[str]:
    """Per model and grid point: tokens/s with its min–max, the measured speedup and its interval,
    the predicted speedup and the share of it achieved (noise said as such)."""
    lines = []
    for i, row in enumerate(report.rows):
        for e in row.speed.values():
            if not e.ok:
                continue
            prompt = f"{e.prompt_len}" + (f", output {e.output_len}" if e.output_len is not UNSET else "")
            measured = interval = pred = shares = "—"
            if i > 0 and e.speedup is not UNSET:
                measured = speedup_text(e)
                iv = opt(e.speedup_interval)
                interval = "n/a" if iv is None else f"{iv[0]:.2f}–{iv[1]:.2f}×"
            if i > 0 and e.predicted_speedup_bytes is not UNSET:
                pred = f"{e.predicted_speedup_bytes:.2f}×"
                shares = _pct(e.share_of_predicted, e.share_of_predicted_within_noise)
                if e.predicted_speedup_roofline is not UNSET:
                    pred += f" (roofline {e.predicted_speedup_roofline:.2f}×)"
                    shares += (" (roofline " + _pct(e.share_of_predicted_roofline,
                                                    e.share_of_predicted_roofline_within_noise) + ")")
            lines.append(f"| {row.name} | {e.batch} | {prompt} | {_tps_text(e)} | {measured} | {interval} | "
                         f"{pred} | {shares} | {'yes' if e.memory_bound else 'no'} | "
                         f"{_pct(e.roofline_fraction)} |")
    if not lines:
        return []
    return ["| model | batch | prompt | tok/s median (min–max) | measured speedup | interval | predicted | "
            "share of predicted | memory-bound | % of copy bandwidth |", "|---|---|---|---|---|---|---|---|---|---|"] + lines


def speed_section(report: Report) -> list[str]:
    """The report's speed section: how to read it, then `speed_table`."""
    table = speed_table(report)
    if not table:
        return []
    return ["", "## Decode speed, its spread, and the prediction", "",
            "Tokens/s is the median over the repetitions, with the slowest and fastest repetition. A speedup's "
            f"interval runs from this model's slowest repetition over {report.baseline}'s fastest to its fastest "
            f"over {report.baseline}'s slowest; where it holds 1, the speedup is {NOISE}. "
            "Predicted from bytes: the bytes a decode step must read (all weights once, plus the filled KV cache) "
            f"of {report.baseline} over this model's, at the same batch and prompt. Where a step is "
            "compute-bound, also from the roofline (FLOPs). Share = (measured − 1) / (predicted − 1): 100% "
            "means the model got all the speed its smaller KV cache promises; a share outside 0–150%, or of a "
            f"speedup {NOISE}, is {NOISE}. "
            + ("All models here were timed in one run, their decode steps alternating one by one, so the "
               "ratios are measured in one run." if report.speed_timed_together else NO_TIMING_TOGETHER),
            ""] + table


def memory_bound_sentence(report: Report) -> list[str]:
    """Per model, in words: which grid points are memory-bound, and how close to the roof they run."""
    lines = []
    for row in report.rows:
        ok = [e for e in row.speed.values() if e.ok]
        if not ok:
            continue
        mb = [point_label(e.axes, "×") for e in ok if e.memory_bound]
        cb = [point_label(e.axes, "×") for e in ok if not e.memory_bound]
        best = max(e.roofline_fraction for e in ok)
        text = f"- **{row.name}**: "
        text += (f"memory-bound at {', '.join(mb)}" if mb else "no grid point is memory-bound")
        text += (f"; compute-bound at {', '.join(cb)}" if cb else "")
        text += f". Best achieved bandwidth: {100 * best:.1f}% of the measured copy bandwidth"
        if best < 0.2:
            text += " (far below the roof: per-step overhead such as kernel launches or Python dominates)"
        lines.append(text + ".")
    return lines


__all__ = ["NOISE", "point_label", "spread", "speedup_interval", "predicted_speedup", "speed_entry", "speedup_text",
           "speed_section", "speed_table", "memory_bound_sentence"]
