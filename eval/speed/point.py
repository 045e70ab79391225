"""One grid point of the decode benchmark: its state while open, and its measurements.

`DecodeBench.open_point` returns an `OpenPoint`; repetitions (`rep`) or single timed
steps (`begin_rep` + `timed_step`) add samples to it; `DecodeBench.close_point` releases
it and `summarize` turns its samples into a `SpeedPoint` with the roofline view (one
`summarize` for every `Bench`, decoder-only or encoder-decoder): bytes a
decode step must read (all weights once, plus the filled part of the KV cache) over the
step time is the achieved bandwidth, quoted as a fraction of the copy bandwidth measured
on the same device, and its arithmetic intensity against the ridge point says whether
the point is memory-bound.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

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


class PointCost(NamedTuple):
    """What one decode step of a grid point must read and compute: `bytes` ({"weights", "kv",
    ..., "total"}, recorded as the point's `bytes_per_step`), `flops`, and `kv_analytic`, the
    bytes of the filled caches the geometry predicts."""

    bytes: dict[str, Any]
    flops: float
    kv_analytic: float


def held_tokens(shares: dict[int, float], depth: int) -> float:
    """Positions' worth of a token's KV bytes a cache at `depth` holds (and a step at that depth
    reads): every position in the full layers, min(window, depth) in the sliding ones, whose
    share of a token's bytes `shares` gives by window (`Shape.window_shares`)."""
    return (1 - sum(shares.values())) * depth + sum(s * min(w, depth) for w, s in shares.items())


def step_cost(bench: Any, pt: OpenPoint) -> PointCost:
    """Minimum bytes a decoder-only step must read: the weights once and the filled cache (mean
    over the steps; a sliding layer reads min(window, depth) positions); its FLOPs. `bench`
    gives the geometry (`weight_bytes`, `matmul_params`, `kv_bytes_per_token`, `layers`,
    `heads`, `head_dim`; `kv_window_shares` where layers slide), whichever engine runs the steps."""
    batch, prompt_len, new_tokens = pt.batch, pt.prompt_len, pt.new_tokens
    mean_len = prompt_len + (new_tokens + 1) / 2
    shares = getattr(bench, "kv_window_shares", None) or {}
    capacity = prompt_len + new_tokens
    if shares:
        depths = range(prompt_len + 1, capacity + 1)  # the positions step i attends to
        kv_read = batch * bench.kv_bytes_per_token * sum(held_tokens(shares, d) for d in depths) / len(depths)
        kv_analytic = batch * held_tokens(shares, capacity) * bench.kv_bytes_per_token
    else:
        kv_read = batch * bench.kv_bytes_per_token * mean_len
        kv_analytic = batch * capacity * bench.kv_bytes_per_token
    bytes_step = bench.weight_bytes + kv_read
    flops_step = 2 * bench.matmul_params * batch + 4 * batch * bench.layers * bench.heads * bench.head_dim * mean_len
    return PointCost(bytes={"weights": bench.weight_bytes, "kv": kv_read, "total": bytes_step}, flops=flops_step,
                     kv_analytic=kv_analytic)


@runtime_checkable
class Bench(Protocol):
    """A timed model: what `summarize`, the grid runners and the alternating runs use, for
    decoder-only models (`bench.DecodeBench`) and encoder-decoders (`seq2seq.Seq2SeqBench`).

    A grid point is `open_point` -> `rep` or `begin_rep` + `timed_step` -> `close_point`;
    `point_cost`, `point_path` and `prefill_fields` are what tells the two kinds apart in
    the point's record."""

    device: Any
    dtype: Any
    weight_bytes: int
    kv_bytes_per_token: int

    def probe(self) -> dict[str, Any]: ...

    def open_point(self, batch: int, prompt_len: int, new_tokens: int, warmup: int, *, prefill_once: bool = ...,
                   **axes: Any) -> OpenPoint: ...

    def rep(self, pt: Any) -> None: ...

    def begin_rep(self, pt: Any) -> None: ...

    def timed_step(self, pt: Any) -> float: ...

    def close_point(self, pt: Any, roof: dict[str, float]) -> SpeedPoint: ...

    def point_cost(self, pt: Any) -> PointCost: ...

    def point_path(self, pt: Any, graph_used: bool) -> tuple[str, dict[str, Any]]: ...

    def prefill_fields(self, pt: Any) -> dict[str, Any]: ...


def summarize(bench: Bench, pt: OpenPoint, roof: dict[str, float], *, peak: int | None,
              graph_used: bool = False) -> SpeedPoint:
    """The measurements of a closed point of `bench` against the device's `roof`: the bytes a
    step must read (`bench.point_cost`) over the step time is the achieved bandwidth, and the
    arithmetic intensity against the ridge point says whether the point is memory-bound."""
    dec = pt.dec
    step = statistics.median(dec)
    cost = bench.point_cost(pt)
    total, flops = cost.bytes["total"], cost.flops
    t_bytes = total / roof["copy_bandwidth"]
    t_flops = flops / roof["matmul_flops"] if roof.get("matmul_flops") else None
    mode, path = bench.point_path(pt, graph_used)
    return SpeedPoint(
        **pt.axes, status="ok", decode_mode=mode, decode_path=path,
        decode_samples=len(dec), decode_sample="one step" if len(dec) > pt.reps else "mean step of a repetition",
        **bench.prefill_fields(pt),
        warmup_s=pt.warmup_s, compile_s=pt.compile_s, reps=pt.reps, packed_weight_bytes=pt.packed_bytes,
        peak_memory_bytes=peak,
        peak_memory_kind="cuda max_memory_allocated" if bench.device.type == "cuda" else "process peak RSS",
        kv_cache_bytes=pt.kv_bytes,
        kv_cache_bytes_analytic=cost.kv_analytic,
        bytes_per_step=cost.bytes,
        flops_per_step=flops,
        roofline_ms={"bytes": 1e3 * t_bytes, "flops": None if t_flops is None else 1e3 * t_flops},
        achieved_bandwidth_gbs=total / step / 1e9,
        roofline_fraction=total / step / roof["copy_bandwidth"],
        arithmetic_intensity=flops / total,
        memory_bound=flops / total < roof["ridge_flops_per_byte"],
        **engine_fields(bench),
    )


def engine_fields(bench: Any) -> dict[str, Any]:
    """The engine a point ran on and, for an external engine, the KV cache it allocated itself."""
    out: dict[str, Any] = {}
    if getattr(bench, "engine", None):
        out["engine"] = bench.engine
    allocation = getattr(bench, "allocation", None)
    if allocation is not None:
        out["engine_kv"] = allocation.record()
    return out
