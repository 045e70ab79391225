"""gqakit's CPU decode kernels (`cpu_kernels.cpp`), built on first use and cached per machine.

`load()` compiles the C++ source with torch's extension builder (a C++ compiler and
ninja are needed; `-march=native`, so the build is cached under a key of the source,
the torch version and this CPU) and returns the module, or None with the reason in
`why_unavailable()`: callers fall back to the oneDNN / matmul decode path and say so.
The first build takes about half a minute; later loads are instant. A build that fails is
recorded in its folder with the compiler and ninja it used, so later processes fall back at
once instead of failing the same build again (a new compiler or ninja builds again).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
from pathlib import Path
from typing import Any, Iterator

_SRC = Path(__file__).with_name("cpu_kernels.cpp")
_STATE: dict[str, Any] = {"tried": False, "mod": None, "why": None}
FAILED = "build-failed.txt"  # in the build folder: a build that failed, with its toolchain and reason


def _cpu_key() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def build_dir() -> Path:
    import torch

    h = hashlib.sha256(_SRC.read_bytes() + torch.__version__.encode() + _cpu_key().encode()).hexdigest()[:16]
    from gqakit.core.files import gqakit_cache_dir

    return gqakit_cache_dir() / "kernels" / h


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
    failed: Path | None = None
    try:
        from torch.utils.cpp_extension import load as build

        d = build_dir()
        d.mkdir(parents=True, exist_ok=True)
        failed = d / FAILED
        earlier = _earlier_failure(failed)
        if earlier is not None:  # this toolchain failed on this source before: not half a minute again
            _STATE["why"] = f"{earlier} (an earlier build; remove {d} to build again)"
            return None
        _STATE["mod"] = build("gqakit_cpu_kernels", [str(_SRC)], build_directory=str(d), verbose=verbose,
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja, an unsupported CPU: the fallback path runs
        first = (str(e).strip().splitlines() or [""])[0][:200]
        _STATE["why"] = f"{type(e).__name__}: {first}"
        if failed is not None:
            with contextlib.suppress(OSError):
                failed.write_text(f"{toolchain()}\n{_STATE['why']}\n")
    return _STATE["mod"]


def toolchain() -> str:
    """What a build depends on besides the source, torch and the CPU: the compiler and ninja found."""
    return f"{shutil.which(os.environ.get('CXX', 'c++'))}|{shutil.which('ninja')}"


def _earlier_failure(marker: Path) -> str | None:
    """The reason an earlier build with this toolchain failed, recorded in `marker`; None if none did."""
    try:
        tools, why = marker.read_text().splitlines()[:2]
    except (OSError, ValueError):
        return None
    return why if tools == toolchain() else None


def why_unavailable() -> str | None:
    """Why `load()` returned None (the first line of the build error, or the switch that disabled it)."""
    return _STATE["why"]


@contextlib.contextmanager
def loaded_afresh() -> Iterator[None]:
    """Inside: `load()` builds or loads the kernels again, as a new process would (reading
    GQAKIT_NO_CPU_KERNELS again); on exit the earlier state is back."""
    saved = dict(_STATE)
    _STATE.clear()
    _STATE.update(tried=False, mod=None, why=None)
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(saved)


@contextlib.contextmanager
def substituted(mod: Any) -> Iterator[Any]:
    """Inside: `load()` returns `mod` (say, a wrapper of the compiled module that labels each
    call for a profiler); on exit the earlier state is back. Yields `mod`."""
    saved = dict(_STATE)
    _STATE.update(tried=True, mod=mod, why=None)
    try:
        yield mod
    finally:
        _STATE.clear()
        _STATE.update(saved)


def ops() -> Any | None:
    """The kernels as `torch.library` custom ops (`torch.ops.gqakit.*`), so that a step under
    `torch.compile` calls them as opaque ops instead of tracing into pybind functions. Eager
    code calls the module directly (no dispatcher overhead); compiled code calls these."""
    if "ops" in _STATE:
        return _STATE["ops"]
    mod = load()
    _STATE["ops"] = None
    if mod is None:
        return None
    import torch

    # schemas spelled out: this module's annotations are strings (`from __future__ import annotations`)
    @torch.library.custom_op("gqakit::panel_linear", mutates_args=(),
                             schema="(Tensor x, Tensor packed, SymInt n, Tensor? bias) -> Tensor")
    def panel_linear(x, packed, n, bias):
        return mod.skinny_linear(x, packed, n, bias)

    @panel_linear.register_fake
    def _(x, packed, n, bias):
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.custom_op("gqakit::decode_attention", mutates_args=(),
                             schema="(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor")
    def decode_attention(query, key, value, mask, scale):
        return mod.decode_attention(query.contiguous(), key.contiguous(), value.contiguous(), mask.contiguous(), scale)

    @decode_attention.register_fake
    def _(query, key, value, mask, scale):
        return query.new_empty((query.shape[0], 1, query.shape[1], value.shape[-1]))

    _STATE["ops"] = torch.ops.gqakit
    return _STATE["ops"]
