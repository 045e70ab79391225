"""Outputs written whole or not at all: temp folders swapped into place, atomic files.

Folders are built under a hidden temporary name next to OUT and swapped into place only
when complete (`swap_in`, the one place that does it). A crash, Ctrl-C or SIGKILL
therefore never leaves a folder at OUT that looks finished; at worst a hidden
`.OUT.gqakit-tmp-*` remains, and the next run removes it once the process that made it is
gone. A failed run removes any parent folder it created, so nothing empty is left behind.
Before anything is written or replaced, the output rule (`core.outrule`) is applied.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from gqakit.core.errors import GqakitError, Interrupted
from gqakit.core.files import follow_umask
from gqakit.core.outrule import (GGUF_FILE, MODEL, TMP_MARK, Inputs, Kind, check_output_path, read_json,
                                 write_manifest)


def _within(p: Path, roots: Iterable[Path]) -> bool:
    """P is one of ROOTS, inside one, or a folder above one (made by `make_dirs`)."""
    p = Path(os.path.abspath(p))
    for r in roots:
        r = Path(os.path.abspath(r))
        if p == r or r in p.parents or p in r.parents:
            return True
    return False


def describe_oserror(e: OSError, path: Path, writing: Iterable[Path] = ()) -> str:
    """One line for a failed file operation while writing PATH (and its temporary folders
    WRITING): disk full and quota named as such; a failure on a file outside them (a source
    moved or deleted while gqakit ran) named as a read."""
    where = e.filename or path
    if e.errno == errno.ENOSPC:
        return f"no space left on the device (disk full or over quota?) while writing {where}"
    if e.errno == getattr(errno, "EDQUOT", -1):
        return f"disk quota exceeded while writing {where}"
    reading = bool(e.filename) and not _within(Path(os.fsdecode(e.filename)), [Path(path), *writing])
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied while {'reading' if reading else 'writing'} {where}"
    if reading:
        gone = " (moved or deleted while gqakit ran?)" if e.errno == errno.ENOENT else ""
        return f"could not read {where}: {e.strerror or e}{gone}"
    return f"could not write {where}: {e.strerror or e}"


def make_dirs(folder: Path) -> list[Path]:
    """mkdir -p FOLDER; returns the folders it created, outermost first (for `remove_if_empty`)."""
    made: list[Path] = []
    p = Path(folder)
    while not p.exists():
        made.append(p)
        p = p.parent
    made.reverse()
    for d in made:
        d.mkdir(exist_ok=True)
    return made


def remove_if_empty(made: list[Path]) -> None:
    """Undo `make_dirs` for the folders that are still empty, innermost first."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            break


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


def swap_in(tmp: Path, final: Path) -> None:
    """Put the finished folder TMP at FINAL, on the same file system: a rename when FINAL is
    free; otherwise FINAL is renamed aside, TMP takes its place and the old one is deleted.
    At every moment FINAL is either the old folder or the new one, never a mix, and a
    crash leaves at most a hidden `.FINAL.gqakit-tmp-*` beside it. The caller has checked
    that FINAL may be replaced. Every file in TMP first gets the mode the user's umask gives
    (`core.files.follow_umask`: libraries that write through temporary files leave 0600)."""
    follow_umask(tmp)
    if not (final.exists() or final.is_symlink()):
        os.rename(tmp, final)
        return
    old = final.parent / f".{final.name}{TMP_MARK}{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _publish(tmp: Path, out: Path, *, overwrite: bool, inputs: Inputs, kind: Kind, flag: str,
             entries: Iterable[str] | None = None) -> None:
    """Write the manifest into the finished folder TMP and swap it in at OUT (replacing an
    earlier gqakit output there only after checking again: OUT may have appeared or
    changed while the work ran). ENTRIES: the manifest's, when not every file in TMP."""
    write_manifest(tmp, kind, entries)
    swap_in(tmp, check_output_path(out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag))


def _fresh_temp(out: Path) -> tuple[Path, list[Path]]:
    """A new hidden temporary folder beside OUT (stale ones of dead runs removed first), and
    the parent folders this call created; on an OSError, those parents go and the error is
    one line."""
    made: list[Path] = []
    try:
        made = make_dirs(out.parent)
        _remove_stale_temps(out)
        tmp = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as e:
        remove_if_empty(made)
        raise GqakitError(describe_oserror(e, out)) from None
    return tmp, made


@contextmanager
def _removed_on_failure(tmp: Path, made: list[Path], out: Path) -> Iterator[None]:
    """On any failure inside: the temporary folder and the parents `_fresh_temp` made are
    removed; an OSError becomes a one-line GqakitError naming OUT."""
    try:
        yield
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_if_empty(made)
        raise GqakitError(describe_oserror(e, out, [tmp])) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_if_empty(made)
        raise


@contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool = False, src: Path | None = None, inputs: Inputs = (),
                      kind: Kind = MODEL, flag: str = "output", entries: Iterable[str] | None = None
                      ) -> Iterator[Path]:
    """Yield a fresh temporary folder; on success write the manifest and rename it to OUT.

    The manifest lists every file in the folder, or ENTRIES when given (`name/` for a part
    whose content the kind checks, as a demo folder's models). On failure the temporary
    folder and any parent folder this call created are removed. OSErrors (disk full,
    permission denied) become one-line GqakitErrors.
    """
    inputs = list(inputs) + ([("source", src)] if src is not None else [])
    out = check_output_path(out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag)
    tmp, made = _fresh_temp(out)
    with _removed_on_failure(tmp, made, out):
        yield tmp
        _publish(tmp, out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag, entries=entries)


PARTIAL_MARK = ".gqakit-partial"
PARTIAL_STAMP = "gqakit_partial.json"
RESUME_DIR = ".resume"  # inside the partial folder: a run that saved its resume state there is kept on failure


def partial_dir(out: Path) -> Path:
    out = Path(out).expanduser().resolve()
    return out.parent / f".{out.name}{PARTIAL_MARK}"


@contextmanager
def resumable_output_dir(out: Path, *, fingerprint: str, overwrite: bool = False, src: Path | None = None,
                         inputs: Inputs = (), kind: Kind = MODEL, flag: str = "output") -> Iterator[tuple[Path, bool]]:
    """Like `atomic_output_dir`, for long runs: the work folder `.OUT.gqakit-partial` is kept
    when the run fails or is killed, and a later run of the same command (same
    `fingerprint`) resumes in it. Yields (folder, resumed). A partial folder of another
    command is replaced; one without gqakit's stamp is never touched. The folder is kept
    only once the run has saved something to resume from (a `RESUME_DIR` in it); before
    that a failure removes it, like `atomic_output_dir`."""
    inputs = list(inputs) + ([("source", src)] if src is not None else [])
    out = check_output_path(out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag)
    part = partial_dir(out)
    stamp = part / PARTIAL_STAMP
    resumed = False
    made: list[Path] = []
    try:
        made = make_dirs(out.parent)
        if part.exists():
            info = read_json(stamp)
            if not isinstance(info, dict):
                raise GqakitError(f"{part} exists and was not left by gqakit; move it away")
            if _alive(int(info.get("pid") or 0)):
                raise GqakitError(f"another gqakit run (pid {info['pid']}) is writing {out}")
            if info.get("fingerprint") == fingerprint:
                resumed = True
            else:
                shutil.rmtree(part)
        part.mkdir(exist_ok=resumed)
        stamp.write_text(json.dumps({"fingerprint": fingerprint, "pid": os.getpid()}) + "\n")
    except OSError as e:
        remove_if_empty(made)
        raise GqakitError(describe_oserror(e, out, [part])) from None
    except GqakitError:
        remove_if_empty(made)
        raise
    try:
        yield part, resumed
    except BaseException as e:
        if not (part / RESUME_DIR).is_dir():
            shutil.rmtree(part, ignore_errors=True)
            remove_if_empty(made)
            if isinstance(e, OSError):
                raise GqakitError(describe_oserror(e, out, [part])) from None
            raise
        kept = f"finished layers are kept in {part}; re-run the same command to resume"
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"stopped; {kept}") from None
        if isinstance(e, (GqakitError, OSError)):
            msg = describe_oserror(e, out, [part]) if isinstance(e, OSError) else str(e)
            raise GqakitError(f"{msg} ({kept})") from None
        raise
    try:
        shutil.rmtree(part / RESUME_DIR, ignore_errors=True)
        stamp.unlink()
        _publish(part, out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag)
    except OSError as e:
        raise GqakitError(describe_oserror(e, out, [part])) from None


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


def write_file_atomic(out: Path, text: str) -> Path:
    """Write a file through a temp file and a rename; a failure leaves neither behind."""
    out = Path(out).expanduser()
    made: list[Path] = []
    tmp = out.with_name(f".{out.name}{TMP_MARK}{os.getpid()}")
    try:
        made = make_dirs(out.parent)
        tmp.write_text(text)
        follow_umask(tmp)
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        remove_if_empty(made)
        raise GqakitError(describe_oserror(e, out, [tmp])) from None
    return out


@contextmanager
def atomic_output_file(out: Path, *, overwrite: bool = False, inputs: Inputs = (), kind: Kind = GGUF_FILE,
                       flag: str = "output") -> Iterator[tuple[Path, Path]]:
    """The single-file twin of `atomic_output_dir`: yields (file to write, scratch folder).

    Both live in a hidden temporary folder next to OUT (`.OUT.gqakit-tmp-*`, cleaned by a
    later run when its process is gone). On success the file is renamed onto OUT, after
    the output rule is checked again; on any failure the temporary folder and any parent
    folder this call created are removed, so nothing at OUT looks complete."""
    out = check_output_path(out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag)
    tmp, made = _fresh_temp(out)
    with _removed_on_failure(tmp, made, out):
        yield tmp / out.name, tmp / ".scratch"
        out = check_output_path(out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag)
        follow_umask(tmp / out.name)
        os.replace(tmp / out.name, out)
        shutil.rmtree(tmp, ignore_errors=True)
