"""Devices: `--device auto|cpu|cuda[:N]` for every verb, and how much memory one has free."""

from __future__ import annotations

import os
import re
from typing import Any

from gqakit.core.errors import GqakitError

_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def check_device(device: str | None) -> None:
    """The spelling of --device, checked before torch is imported."""
    if device is not None and not _DEVICE.match(str(device)):
        raise GqakitError(f"--device must be auto, cpu, cuda, cuda:N or mps; got {device!r}")


def resolve_device(device: str | None) -> str:
    """'auto' (or None): the first CUDA GPU when present, else the CPU. Anything else is checked."""
    import torch

    check_device(device)
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise GqakitError(f"--device {device} requested but no CUDA device is available")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise GqakitError(f"--device {device}: there are only {torch.cuda.device_count()} CUDA devices")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise GqakitError("--device mps requested but MPS is not available")
    return device


def proc_bytes(path: str, key: str) -> int | None:
    """A 'kB' field of a /proc file (MemAvailable, VmHWM...) in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory(device: Any) -> int:
    """Bytes the next allocations may use: free GPU memory, or MemAvailable on the host."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    avail = proc_bytes("/proc/meminfo", "MemAvailable:")
    if avail is not None:
        return avail
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak memory of one region: CUDA's allocator peak, or the process's peak RSS on Linux.

    Writing "5" to /proc/self/clear_refs resets VmHWM (the RSS high-water mark), so the
    CPU figure covers this region only; it is the whole process (weights included).
    """

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)

    def reset(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass

    def peak(self) -> int | None:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return proc_bytes("/proc/self/status", "VmHWM:")
