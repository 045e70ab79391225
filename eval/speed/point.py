"""One grid point of the decode benchmark: its state while open, and its measurements.

`DecodeBench.open_point` returns an `OpenPoint`; repetitions (`rep`) or single timed
steps (`begin_rep` + `timed_step`) add samples to it; `DecodeBench.close_point` releases
it and `summarize` turns its samples into a `SpeedPoint` with the roofline view: bytes a
decode step must read (all weights once, plus the filled part of the KV cache) over the
step time is the achieved bandwidth, quoted as a fraction of the copy bandwidth measured
on the same device, and its arithmetic intensity against the ridge point says whether
the point is memory-bound.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from typing import Any

from gqakit.core.device import PeakMemory
from gqakit.eval.records import SpeedPoint
from gqakit.eval.speed.roofline import percentile


@dataclass
class OpenPoint:
    """The state of one open grid point (batch x prompt length, `new_tokens` decode steps)."""

    batch: int
    prompt_len: int
    new_tokens: int
    result: SpeedPoint | None = None   # set when the point does not run (out of memory, predicted or real)
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # packed weights while open
    peak: PeakMemory | None = None
    cache: Any = None
    graph: Any = None                  # a checked CapturedStep, or None: eager steps
    rewind: bool = False               # decode repetitions rewind the cache to the one prefilled prompt
    tok: Any = None                    # the first greedy token after the prompt
    tok0: Any = None                   # the token the current repetition starts from
    cur: Any = None                    # the last token of the current repetition
    i: int = 0                         # steps taken in the current repetition
    pre: list[float] = field(default_factory=list)   # prefill samples, seconds
    dec: list[float] = field(default_factory=list)   # decode samples, seconds per step
    reps: int = 0
    warmup_s: float = 0.0
    compile_s: float | None = None
    kv_bytes: int = 0
    packed_bytes: int = 0

    @property
    def axes(self) -> dict[str, int]:
        return {"batch": self.batch, "prompt_len": self.prompt_len, "new_tokens": self.new_tokens}


def timings(batch: int, pre: list[float], dec: list[float]) -> dict[str, Any]:
    """The timing fields of a `SpeedPoint` from its samples (seconds): median, p90 and the spread
    (min, max) over the repetitions, so a ratio of two points can say whether it is above the noise."""
    step = statistics.median(dec)
    out: dict[str, Any] = {
        "decode_ms_per_token": {"median": 1e3 * step, "p90": 1e3 * percentile(dec, 90),
                                "min": 1e3 * min(dec), "max": 1e3 * max(dec)},
        "tokens_per_s": {"median": batch / step, "p90_of_step_time": batch / percentile(dec, 90),
                         "min": batch / max(dec), "max": batch / min(dec)}}
    if pre:
        out["prefill_ms"] = {"median": 1e3 * statistics.median(pre), "p90": 1e3 * percentile(pre, 90),
                             "min": 1e3 * min(pre), "max": 1e3 * max(pre)}
    return out


def summarize(bench: Any, pt: OpenPoint, roof: dict[str, float], *, graph_used: bool, peak: int | None) -> SpeedPoint:
    """The measurements of a closed point of `bench` (a `DecodeBench`) against the device's `roof`."""
    batch, prompt_len, new_tokens = pt.batch, pt.prompt_len, pt.new_tokens
    pre, dec, reps = pt.pre, pt.dec, pt.reps
    step = statistics.median(dec)
    # Minimum bytes a step must read: weights once + the filled cache (mean over steps).
    mean_len = prompt_len + (new_tokens + 1) / 2
    kv_read = batch * bench.kv_bytes_per_token * mean_len
    bytes_step = bench.weight_bytes + kv_read
    flops_step = 2 * bench.matmul_params * batch + 4 * batch * bench.layers * bench.heads * bench.head_dim * mean_len
    intensity = flops_step / bytes_step
    achieved = bytes_step / step
    t_bytes = bytes_step / roof["copy_bandwidth"]
    t_flops = flops_step / roof["matmul_flops"] if roof.get("matmul_flops") else None
    mode = "CUDA graph per step" if graph_used else bench.decode_mode
    layers: dict[str, Any] = {}
    if bench.kernels is not None and not bench.compiled:
        if bench.fused is not None:
            layers["layers"] = "fused, one compiled call per layer"
            if bench.fused_huge_fraction is not None:
                layers["packed_on_huge_pages"] = round(bench.fused_huge_fraction, 3)
        else:
            layers["layers"] = "per-op (transformers' modules)" + (f": {bench.fused_note}" if bench.fused_note else "")
    weights = ("as loaded" if not pt.packed_bytes else "packed once (gqakit panels)" if bench.kernels is not None
               else "packed once (oneDNN)")
    return SpeedPoint(
        **pt.axes, status="ok", decode_mode=mode,
        decode_path={"steps": mode, "weights": weights, "attention_kernel": bench.decode_kernel, **layers,
                     "prefill": "every repetition" if len(pre) >= reps else "once, decode repetitions rewind the cache"},
        decode_samples=len(dec), decode_sample="one step" if len(dec) > reps else "mean step of a repetition",
        prefill_samples=len(pre), **timings(batch, pre, dec),
        warmup_s=pt.warmup_s, compile_s=pt.compile_s, reps=reps, packed_weight_bytes=pt.packed_bytes,
        peak_memory_bytes=peak,
        peak_memory_kind="cuda max_memory_allocated" if bench.device.type == "cuda" else "process peak RSS",
        kv_cache_bytes=pt.kv_bytes,
        kv_cache_bytes_analytic=batch * (prompt_len + new_tokens) * bench.kv_bytes_per_token,
        bytes_per_step={"weights": bench.weight_bytes, "kv": kv_read, "total": bytes_step},
        flops_per_step=flops_step,
        roofline_ms={"bytes": 1e3 * t_bytes, "flops": None if t_flops is None else 1e3 * t_flops},
        achieved_bandwidth_gbs=achieved / 1e9,
        roofline_fraction=achieved / roof["copy_bandwidth"],
        arithmetic_intensity=intensity,
        memory_bound=intensity < roof["ridge_flops_per_byte"],
    )
