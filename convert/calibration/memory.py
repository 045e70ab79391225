"""Memory housekeeping between blocks: the device's cache, and freed heap handed back to the OS."""

from __future__ import annotations

import torch


def empty_cache(device: str) -> None:
    """Return freed memory: the CUDA cache on a GPU, the C heap on the CPU."""
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    else:
        trim()


def trim() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise), so RSS tracks use."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
