"""Write an output folder atomically: all or nothing.

Every stage builds its folder under a hidden temporary name next to OUT and renames it
into place only when complete. A crash, Ctrl-C or SIGKILL therefore never leaves a
folder at OUT that looks finished; at worst a hidden `.OUT.gqakit-tmp-*` remains, and
the next run removes it once the process that made it is gone.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gqakit.core.errors import GqakitError

TMP_MARK = ".gqakit-tmp-"


def _is_inside(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_output_path(out: Path, *, overwrite: bool, src: Path | None = None) -> Path:
    """Validate OUT before any work is done; returns the resolved path."""
    out = Path(out).expanduser().resolve()
    if src is not None and Path(src).exists():
        src = Path(src).expanduser().resolve()
        if out == src or (src.is_dir() and _is_inside(out, src)):
            raise GqakitError(f"output {out} is the source or inside it; choose a folder outside {src}")
        if _is_inside(src, out):
            raise GqakitError(f"output {out} contains the source {src}; --overwrite would delete it")
    if out.exists() and not overwrite:
        if out.is_dir() and not any(out.iterdir()):
            return out  # an empty folder is fine to fill
        raise GqakitError(f"output {out} already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise GqakitError(f"output {out} exists and is not a folder")
    return out


def _remove_stale_temps(out: Path) -> None:
    """Remove temp folders of earlier runs for this OUT whose process is gone."""
    prefix = f".{out.name}{TMP_MARK}"
    if not out.parent.is_dir():
        return
    for p in out.parent.glob(prefix + "*"):
        try:
            pid = int(p.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            alive = pid != os.getpid()
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            shutil.rmtree(p, ignore_errors=True)


def _describe_oserror(e: OSError, out: Path) -> str:
    if e.errno == errno.ENOSPC:
        return f"no space left on the device while writing {out}"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied while writing {out} ({e.filename or out})"
    return f"could not write {out}: {e.strerror or e}"


@contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool = False, src: Path | None = None) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success rename it to OUT, on failure delete it.

    OSErrors (disk full, permission denied) become one-line GqakitErrors.
    """
    out = check_output_path(out, overwrite=overwrite, src=src)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(out)
        tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as e:
        raise GqakitError(_describe_oserror(e, out)) from None
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GqakitError(_describe_oserror(e, out)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
