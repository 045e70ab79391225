"""Outputs: one rule for where gqakit may write, and atomic folders.

The rule, applied by every verb before it writes or deletes anything:
  1. An output may never be, contain, or sit inside any input of the same command
     (model, teacher, data files, eval file, results files, the config itself).
  2. An existing output is replaced only with `--overwrite`, and only when gqakit wrote
     it: a folder must carry gqakit's manifest (`.gqakit-output.json`, which lists every
     file gqakit put there) and hold no other file; a results file must be a gqakit
     results JSON. Anything else is refused, with or without `--overwrite`.
  3. The caller deletes nothing until every other check of the command has passed.

Folders are built under a hidden temporary name next to OUT and renamed into place only
when complete. A crash, Ctrl-C or SIGKILL therefore never leaves a folder at OUT that
looks finished; at worst a hidden `.OUT.gqakit-tmp-*` remains, and the next run removes
it once the process that made it is gone. A failed run removes any parent folder it
created, so nothing empty is left behind.

This module imports nothing heavy: the checks run before torch is imported.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gqakit.core.errors import GqakitError, Interrupted

TMP_MARK = ".gqakit-tmp-"
MANIFEST = ".gqakit-output.json"

# (label, path): what an input is called in messages, and where it is.
Inputs = Sequence[tuple[str, "str | Path | None"]]


# ----------------------------------------------------------------------------- kinds of output


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _schema(path: Path) -> str | None:
    data = _json(path)
    return data.get("schema") if isinstance(data, dict) else None


@dataclass(frozen=True)
class Kind:
    """One kind of output: a folder (with a manifest) or a single file."""

    name: str                                   # in messages: "model folder", "uptrain run", ...
    folder: bool = True
    legacy: Callable[[Path], bool] | None = None  # recognises outputs written before manifests
    file_ok: Callable[[Path], bool] | None = None  # file kinds: is this file one gqakit wrote?


RUN_ENTRIES = ("gqakit_uptrain.yaml", "log.jsonl", "checkpoints/", "model/", "uptrain/")


def _legacy_run(p: Path) -> bool:
    tops = {e.rstrip("/") for e in RUN_ENTRIES}
    return (p / "gqakit_uptrain.yaml").is_file() and not (p / "config.json").exists() and all(
        c.name in tops for c in p.iterdir())


def _legacy_report(p: Path) -> bool:
    return _schema(p / "report.json") == "gqakit.compare/1" and all(
        c.name in ("report.json", "report.md") or c.suffix == ".png" for c in p.iterdir())


MODEL = Kind("model folder", legacy=lambda p: (p / "gqakit_convert.json").is_file())
RUN = Kind("uptrain run", legacy=_legacy_run)
REPORT = Kind("compare report", legacy=_legacy_report)
DEMO = Kind("demo folder", legacy=lambda p: (p / "converted" / "gqakit_convert.json").is_file()
            and (p / "report").is_dir())
RESULTS = Kind("results file", folder=False, file_ok=lambda p: _schema(p) == "gqakit.eval/1")
KINDS = {k.name: k for k in (MODEL, RUN, REPORT, DEMO, RESULTS)}


def write_manifest(folder: Path, kind: Kind, entries: Iterable[str] | None = None) -> None:
    """Record that gqakit wrote FOLDER: its kind and every file in it (or `dir/` prefixes)."""
    import gqakit

    if entries is None:
        entries = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    body = {"written_by": "gqakit", "gqakit": gqakit.__version__, "kind": kind.name,
            "entries": [e for e in entries if e != MANIFEST]}
    (folder / MANIFEST).write_text(json.dumps(body, indent=1) + "\n")


def _foreign(folder: Path, entries: list[str]) -> list[str]:
    """Files under FOLDER that the manifest's entries do not cover."""
    exact = {e for e in entries if not e.endswith("/")}
    prefixes = tuple(e for e in entries if e.endswith("/"))
    out = []
    for p in sorted(folder.rglob("*")):
        if p.is_dir() and not p.is_symlink():
            continue
        rel = str(p.relative_to(folder))
        if rel != MANIFEST and rel not in exact and not rel.startswith(prefixes):
            out.append(rel)
    return out


def why_not_ours(out: Path, kind: Kind) -> str | None:
    """None when OUT is a `kind` output that gqakit wrote and may replace; else the reason."""
    if kind.folder:
        if not out.is_dir():
            return f"it is a file, not a {kind.name}"
        man = _json(out / MANIFEST)
        if isinstance(man, dict) and man.get("written_by") == "gqakit":
            if man.get("kind") != kind.name:
                return f"it is a gqakit {man.get('kind')}, not a {kind.name}"
            entries = man.get("entries")
            if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
                return f"its manifest {MANIFEST} is damaged"
            foreign = _foreign(out, entries)
            if foreign:
                return f"it holds {foreign[0]!r}, which gqakit did not write" + (
                    f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else "")
            return None
        if kind.legacy is not None and kind.legacy(out):
            return None
        return f"it was not written by gqakit (no {MANIFEST})"
    if out.is_dir():
        return "it is a folder"
    if kind.file_ok is not None and kind.file_ok(out):
        return None
    return f"it is not a gqakit {kind.name}"


# ----------------------------------------------------------------------------- the rule


def _resolve(p: str | Path) -> Path:
    return Path(p).expanduser().resolve()


def _is_inside(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return child != parent
    except ValueError:
        return False


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_not_an_input(out: Path, inputs: Inputs, flag: str = "output") -> Path:
    """Rule 1: OUT is not, does not contain, and does not sit inside any input."""
    out = _resolve(out)
    for label, path in inputs:
        if path is None:
            continue
        inp = _resolve(path)
        if _same(out, inp):
            raise GqakitError(f"{flag} {out} is the {label}; choose another path")
        if _is_inside(out, inp):
            raise GqakitError(f"{flag} {out} is inside the {label} {inp}; choose a path outside it")
        if _is_inside(inp, out):
            raise GqakitError(f"{flag} {out} contains the {label} {inp}; choose a path that does not")
    return out


def check_output_path(out: Path, *, overwrite: bool, src: Path | None = None, inputs: Inputs = (),
                      kind: Kind = MODEL, flag: str = "output") -> Path:
    """Rules 1 and 2, before any work is done; returns the resolved path. Deletes nothing."""
    inputs = list(inputs) + ([("source", src)] if src is not None else [])
    out = check_not_an_input(out, inputs, flag)
    if not out.exists() and not out.is_symlink():
        return out
    if kind.folder and out.is_dir() and not any(out.iterdir()):
        return out  # an empty folder is fine to fill
    if not overwrite:
        raise GqakitError(f"{flag} {out} already exists; pass --overwrite to replace it")
    why = why_not_ours(out, kind)
    if why:
        raise GqakitError(f"{flag} {out} exists and {why}; --overwrite replaces only a {kind.name} "
                          "that gqakit wrote: move it away or choose another path")
    return out


# ----------------------------------------------------------------------------- writing


def describe_oserror(e: OSError, path: Path) -> str:
    """One line for a failed write: disk full and quota named as such, with the path."""
    where = e.filename or path
    if e.errno == errno.ENOSPC:
        return f"no space left on the device (disk full or over quota?) while writing {where}"
    if e.errno == getattr(errno, "EDQUOT", -1):
        return f"disk quota exceeded while writing {where}"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied while writing {where}"
    return f"could not write {where}: {e.strerror or e}"


_describe_oserror = describe_oserror  # the old private name


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


def _publish(tmp: Path, out: Path, *, overwrite: bool, inputs: Inputs, kind: Kind, flag: str) -> None:
    """Write the manifest into the finished folder TMP and rename it to OUT (replacing an
    earlier gqakit output there only after checking again: OUT may have appeared or
    changed while the work ran)."""
    write_manifest(tmp, kind)
    out = check_output_path(out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag)
    if out.exists():
        old = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


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
        raise GqakitError(describe_oserror(e, out)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_if_empty(made)
        raise


@contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool = False, src: Path | None = None, inputs: Inputs = (),
                      kind: Kind = MODEL, flag: str = "output") -> Iterator[Path]:
    """Yield a fresh temporary folder; on success write the manifest and rename it to OUT.

    On failure the temporary folder and any parent folder this call created are removed.
    OSErrors (disk full, permission denied) become one-line GqakitErrors.
    """
    inputs = list(inputs) + ([("source", src)] if src is not None else [])
    out = check_output_path(out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag)
    tmp, made = _fresh_temp(out)
    with _removed_on_failure(tmp, made, out):
        yield tmp
        _publish(tmp, out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag)


PARTIAL_MARK = ".gqakit-partial"
PARTIAL_STAMP = "gqakit_partial.json"
RESUME_DIR = ".resume"  # inside the partial folder: a run that saved a checkpoint there is kept on failure


def partial_dir(out: Path) -> Path:
    out = _resolve(out)
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
            info = _json(stamp)
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
        raise GqakitError(describe_oserror(e, out)) from None
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
                raise GqakitError(describe_oserror(e, out)) from None
            raise
        kept = f"finished layers are kept in {part}; re-run the same command to resume"
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"stopped; {kept}") from None
        if isinstance(e, (GqakitError, OSError)):
            msg = describe_oserror(e, out) if isinstance(e, OSError) else str(e)
            raise GqakitError(f"{msg} ({kept})") from None
        raise
    try:
        shutil.rmtree(part / RESUME_DIR, ignore_errors=True)
        stamp.unlink()
        _publish(part, out, overwrite=overwrite, inputs=inputs, kind=kind, flag=flag)
    except OSError as e:
        raise GqakitError(describe_oserror(e, out)) from None


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
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        remove_if_empty(made)
        raise GqakitError(describe_oserror(e, out)) from None
    return out


# ----------------------------------------------------------------------------- single-file outputs


def _is_gqakit_gguf(path: Path) -> bool:
    """A GGUF file that `gqakit convert` wrote (it carries `general.gqakit.version`)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
        from gguf import GGUFReader

        return "general.gqakit.version" in GGUFReader(path).fields
    except Exception:  # a damaged file is not one gqakit may replace
        return False


GGUF_FILE = Kind("GGUF file", folder=False, file_ok=_is_gqakit_gguf)
KINDS[GGUF_FILE.name] = GGUF_FILE


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
        os.replace(tmp / out.name, out)
        shutil.rmtree(tmp, ignore_errors=True)
