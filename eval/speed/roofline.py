"""The device's roofs and what they predict for a decode step.

A decode step must read every weight once plus the filled KV cache. `copy_bandwidth` and
`matmul_flops` measure the practical roofs of the device (a large device-to-device copy,
a square matmul in the step's dtype); their ratio is the ridge point that says whether a
step is memory-bound. `predict_speedup` turns two steps' costs into the speedup the
roofline predicts for one over the other: by bytes, by the roofline (each step at
max(bytes / copy bandwidth, FLOPs / matmul FLOP/s)), and with no overlap of memory and
compute (the sum: the pessimistic end near the ridge point). `gqakit compare` and the
benchmark scripts both use it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping


def sync(device: Any) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Any, device: Any, reps: int) -> float:
    """Median seconds of `fn()` over `reps` synchronized runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: Any, nbytes: int | None = None, reps: int = 5) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), the practical roof."""
    import torch

    dev = torch.device(device)
    nbytes = nbytes or (1 << 30 if dev.type == "cuda" else 256 << 20)
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), dev, reps)
    return 2 * nbytes / t


def matmul_flops(device: Any, dtype: Any, n: int | None = None, reps: int = 3) -> float:
    """FLOP/s of a square matmul in `dtype`: the compute roof for the ridge point."""
    import torch

    dev = torch.device(device)
    n = n or (8192 if dev.type == "cuda" else 1024)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = median_time(lambda: a @ b, dev, reps)
    return 2 * n ** 3 / t


def roof(copy_bw: float, flops: float) -> dict[str, float]:
    """The roof of a device as the benchmark passes it around: copy bandwidth, matmul FLOP/s, ridge."""
    return {"copy_bandwidth": copy_bw, "matmul_flops": flops, "ridge_flops_per_byte": flops / copy_bw}


def measure_roof(device: Any, dtype: Any) -> dict[str, float]:
    """Both roofs of `device`, measured now."""
    return roof(copy_bandwidth(device), matmul_flops(device, dtype))


def median_roof(roofs: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The median of several measurements of the roofs (each roof on its own)."""
    roofs = list(roofs)
    return roof(statistics.median(r["copy_bandwidth"] for r in roofs),
                statistics.median(r["matmul_flops"] for r in roofs))


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ----------------------------------------------------------------------------- predictions

@dataclass(frozen=True)
class StepCost:
    """What one measured decode step costs by the roofline (from a grid point)."""

    bytes: float              # bytes the step must read: weights once + the filled KV cache
    bytes_ms: float | None    # bytes / copy bandwidth
    flops_ms: float | None    # FLOPs / matmul FLOP/s (None where the FLOP roof was not measured)
    memory_bound: bool | None

    @classmethod
    def of(cls, point: Any) -> "StepCost | None":
        """The cost of a grid point (a `SpeedPoint` or its JSON form); None where it lacks the numbers."""
        get = point.get if isinstance(point, Mapping) else lambda k: getattr(point, k, None)
        total = (get("bytes_per_step") or {}).get("total")
        if not total:
            return None
        rl = get("roofline_ms") or {}
        return cls(bytes=total, bytes_ms=rl.get("bytes"), flops_ms=rl.get("flops"), memory_bound=get("memory_bound"))


@dataclass(frozen=True)
class Prediction:
    """The speedup of one step over a baseline step that the roofline predicts."""

    bytes: float                # ratio of bytes read (baseline over other)
    roofline: float | None      # ratio of max(bytes time, FLOPs time)
    no_overlap: float | None    # ratio of bytes time + FLOPs time (None without both FLOP times)
    compute_bound: bool         # either step is not memory-bound


def predict_speedup(base: StepCost, other: StepCost) -> Prediction:
    """What the roofline predicts for `other` against `base` (same batch and prompt)."""
    roofline = no_overlap = None
    if base.bytes_ms is not None and other.bytes_ms is not None:
        roofline = max(base.bytes_ms, base.flops_ms or 0) / max(other.bytes_ms, other.flops_ms or 0)
        if base.flops_ms and other.flops_ms:
            no_overlap = (base.bytes_ms + base.flops_ms) / (other.bytes_ms + other.flops_ms)
    return Prediction(bytes=base.bytes / other.bytes, roofline=roofline, no_overlap=no_overlap,
                      compute_bound=not (base.memory_bound and other.memory_bound))


def share(measured: float, predicted: float | None) -> float | None:
    """(measured - 1) / (predicted - 1): the share of the predicted gain that showed up."""
    return None if predicted is None or abs(predicted - 1) < 1e-9 else (measured - 1) / (predicted - 1)
