"""Write an output folder atomically: all or nothing.

Every stage builds its folder under a hidden temporary name next to OUT and renames it
into place only when complete. A crash, Ctrl-C or SIGKILL therefore never leaves a
folder at OUT that looks finished; at worst a hidden `.OUT.gqakit-tmp-*` remains, and
the next run removes it once the process that made it is gone.
"""

from __future__ import annotations

import errno
import json
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


PARTIAL_MARK = ".gqakit-partial"
PARTIAL_STAMP = "gqakit_partial.json"
RESUME_DIR = ".resume"  # inside the partial folder: a run that saved a checkpoint there is kept on failure


def partial_dir(out: Path) -> Path:
    out = Path(out).expanduser().resolve()
    return out.parent / f".{out.name}{PARTIAL_MARK}"


@contextmanager
def resumable_output_dir(out: Path, *, fingerprint: str, overwrite: bool = False,
                         src: Path | None = None) -> Iterator[tuple[Path, bool]]:
    """Like `atomic_output_dir`, for long runs: the work folder `.OUT.gqakit-partial` is kept
    when the run fails or is killed, and a later run of the same command (same
    `fingerprint`) resumes in it. Yields (folder, resumed). A partial folder of another
    command is replaced; one without gqakit's stamp is never touched."""
    out = check_output_path(out, overwrite=overwrite, src=src)
    part = partial_dir(out)
    stamp = part / PARTIAL_STAMP
    resumed = False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if part.exists():
            try:
                info = json.loads(stamp.read_text())
            except (OSError, ValueError):
                raise GqakitError(f"{part} exists and was not left by gqakit; move it away") from None
            if _alive(int(info.get("pid", 0))):
                raise GqakitError(f"another gqakit run (pid {info['pid']}) is writing {out}")
            if info.get("fingerprint") == fingerprint:
                resumed = True
            else:
                shutil.rmtree(part)
        part.mkdir(exist_ok=resumed)
        stamp.write_text(json.dumps({"fingerprint": fingerprint, "pid": os.getpid()}) + "\n")
    except OSError as e:
        raise GqakitError(_describe_oserror(e, out)) from None
    try:
        yield part, resumed
    except BaseException as e:
        if not (part / RESUME_DIR).is_dir():
            shutil.rmtree(part, ignore_errors=True)
            if isinstance(e, OSError):
                raise GqakitError(_describe_oserror(e, out)) from None
            raise
        if isinstance(e, (GqakitError, OSError)):
            msg = _describe_oserror(e, out) if isinstance(e, OSError) else str(e)
            raise GqakitError(f"{msg} (finished layers are kept in {part}; re-run the same command to resume)") from None
        raise
    try:
        shutil.rmtree(part / RESUME_DIR, ignore_errors=True)
        stamp.unlink()
        if out.exists():
            old = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(part, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(part, out)
    except OSError as e:
        raise GqakitError(_describe_oserror(e, out)) from None


def _alive(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
