"""gqakit's CPU decode kernels (`cpu_kernels.cpp`), built on first use and cached per machine.

`load()` compiles the C++ source with torch's extension builder (a C++ compiler and
ninja are needed; `-march=native`, so the build is cached under a key of the source,
the torch version and this CPU) and returns the module, or None with the reason in
`why_unavailable()`: callers fall back to the oneDNN / matmul decode path and say so.
The first build takes about half a minute; later loads are instant.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path
from typing import Any

_SRC = Path(__file__).with_name("cpu_kernels.cpp")
_STATE: dict[str, Any] = {"tried": False, "mod": None, "why": None}


def _cpu_key() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def build_dir() -> Path:
    import torch

    h = hashlib.sha256(_SRC.read_bytes() + torch.__version__.encode() + _cpu_key().encode()).hexdigest()[:16]
    root = Path(os.environ.get("GQAKIT_CACHE", Path.home() / ".cache" / "gqakit"))
    return root / "kernels" / h


def is_built() -> bool:
    """Whether this machine already has the compiled kernels (a later `load` is instant)."""
    try:
        return any(build_dir().glob("gqakit_cpu_kernels*.so"))
    except Exception:
        return False


def load(verbose: bool = False) -> Any | None:
    """The compiled kernels, or None (see `why_unavailable`). Built once per process at most."""
    if _STATE["tried"]:
        return _STATE["mod"]
    _STATE["tried"] = True
    if os.environ.get("GQAKIT_NO_CPU_KERNELS"):
        _STATE["why"] = "disabled by GQAKIT_NO_CPU_KERNELS"
        return None
    try:
        from torch.utils.cpp_extension import load as build

        d = build_dir()
        d.mkdir(parents=True, exist_ok=True)
        _STATE["mod"] = build("gqakit_cpu_kernels", [str(_SRC)], build_directory=str(d), verbose=verbose,
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja, an unsupported CPU: the fallback path runs
        first = (str(e).strip().splitlines() or [""])[0][:200]
        _STATE["why"] = f"{type(e).__name__}: {first}"
    return _STATE["mod"]


def why_unavailable() -> str | None:
    return _STATE["why"]
