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
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
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
    # A manifest entry `name/` covers a sub-folder only as far as its part says: another kind
    # of output (with its own manifest), or a function listing what in it gqakit did not write.
    parts: Mapping[str, "Kind | Callable[[Path], list[str]]"] = field(default_factory=dict)
    entries: tuple[str, ...] = ()               # the entries of a legacy folder (no manifest)


def _files(folder: Path) -> list[str]:
    """Every file, link and empty or unreadable folder (`name/`) under FOLDER, relative, sorted."""
    out: list[str] = []
    failed: list[str] = []
    for root, dirs, files in os.walk(folder, onerror=lambda e: failed.append(str(e.filename))):
        r = Path(root)
        rel = "" if r == folder else str(r.relative_to(folder)) + "/"
        if not dirs and not files and rel:
            out.append(rel)
        for d in [d for d in dirs if (r / d).is_symlink()]:
            dirs.remove(d)
            out.append(rel + d)
        out += [rel + f for f in files]
    out += [str(Path(f).relative_to(folder)) + "/" for f in failed if Path(f) != folder]
    return sorted(set(out))


def _foreign_part(sub: Path, part: "Kind | Callable[[Path], list[str]] | None") -> list[str]:
    if part is None:
        return _files(sub)
    if isinstance(part, Kind):
        man = _json(sub / MANIFEST)
        entries = man.get("entries") if isinstance(man, dict) and man.get("written_by") == "gqakit" else None
        if isinstance(man, dict) and man.get("kind") == part.name and isinstance(entries, list) and all(
                isinstance(e, str) for e in entries):
            return _foreign(sub, entries, part)
        if man is None and part.legacy is not None and part.legacy(sub):
            return _foreign(sub, list(part.entries), part) if part.entries else []
        return _files(sub)
    return part(sub)


def _foreign(folder: Path, entries: list[str], kind: Kind) -> list[str]:
    """What under FOLDER gqakit did not write: not a manifest entry, and under an entry
    `name/` not vouched for by the kind's part of that name, at any depth."""
    exact = {e for e in entries if not e.endswith("/")}
    subs = {e.rstrip("/") for e in entries if e.endswith("/")}
    part_foreign: dict[str, set[str]] = {}
    out = []
    for rel in _files(folder):
        top = rel.split("/", 1)[0]
        if rel == MANIFEST or rel in exact:
            continue
        sub = folder / top
        if top in subs and "/" in rel and sub.is_dir() and not sub.is_symlink():
            if top not in part_foreign:
                part_foreign[top] = {f"{top}/{r}" for r in _foreign_part(sub, kind.parts.get(top))}
            if rel not in part_foreign[top]:
                continue
        out.append(rel)
    return out


CHECKPOINTS = "checkpoints"
CHECKPOINT_RECORD = "trainer_state.json"  # a checkpoint's record: its step and the sha256 of its files
_STEP = re.compile(r"step-\d+")
_STEP_TEMP = re.compile(r"\.step-\d+(\.tmp|" + re.escape(TMP_MARK) + r".*)")
# What accelerate's save_state writes, for checkpoints whose record lists no files.
_SAVE_STATE = re.compile(r"(model|pytorch_model|optimizer|scheduler|sampler)(_\d+)?\.(safetensors|bin)|"
                         r"(random_states|custom_checkpoint)_\d+\.pkl|scaler\.pt")
_TB_EVENTS = re.compile(r"events\.out\.tfevents\..+")
_TB_HPARAMS_DIR = re.compile(r"\d+(\.\d+)?")  # accelerate names it after time.time()


def _foreign_checkpoints(folder: Path) -> list[str]:
    """checkpoints/: `step-N` folders holding what their record lists, and the temporary
    folder of a save cut short."""
    out = []
    for rel in _files(folder):
        top, _, inner = rel.partition("/")
        if _STEP_TEMP.fullmatch(top) and inner:
            continue
        if _STEP.fullmatch(top) and inner:
            record = _json(folder / top / CHECKPOINT_RECORD)
            listed = record.get("files") if isinstance(record, dict) else None
            if inner == CHECKPOINT_RECORD or (inner in listed if isinstance(listed, dict)
                                              else _SAVE_STATE.fullmatch(inner) is not None):
                continue
        out.append(rel)
    return out


def _foreign_tensorboard(folder: Path) -> list[str]:
    """uptrain/: accelerate's tensorboard event files, and its hyper-parameter folders."""
    out = []
    for rel in _files(folder):
        parts = rel.split("/")
        if len(parts) == 1 and _TB_EVENTS.fullmatch(parts[0]):
            continue
        if len(parts) == 2 and _TB_HPARAMS_DIR.fullmatch(parts[0]) and (
                parts[1] == "hparams.yml" or _TB_EVENTS.fullmatch(parts[1])):
            continue
        out.append(rel)
    return out


def _foreign_results(folder: Path) -> list[str]:
    """A folder of eval results files (written by gqakit: `schema: gqakit.eval/1`)."""
    return [rel for rel in _files(folder) if "/" in rel or _schema(folder / rel) != "gqakit.eval/1"]


RUN_ENTRIES = ("gqakit_uptrain.yaml", "log.jsonl", f"{CHECKPOINTS}/", "model/", "uptrain/")


def _legacy_run(p: Path) -> bool:
    tops = {e.rstrip("/") for e in RUN_ENTRIES}
    return (p / "gqakit_uptrain.yaml").is_file() and not (p / "config.json").exists() and all(
        c.name in tops for c in p.iterdir())


def _legacy_report(p: Path) -> bool:
    return _schema(p / "report.json") == "gqakit.compare/1" and all(
        c.name in ("report.json", "report.md") or c.suffix == ".png" for c in p.iterdir())


MODEL = Kind("model folder", legacy=lambda p: (p / "gqakit_convert.json").is_file())
RUN = Kind("uptrain run", legacy=_legacy_run, entries=RUN_ENTRIES,
           parts={CHECKPOINTS: _foreign_checkpoints, "model": MODEL, "uptrain": _foreign_tensorboard})
REPORT = Kind("compare report", legacy=_legacy_report)
DEMO = Kind("demo folder", legacy=lambda p: (p / "converted" / "gqakit_convert.json").is_file()
            and (p / "report").is_dir(),
            parts={"converted": MODEL, "mean": MODEL, "uptrain": RUN, "results": _foreign_results, "report": REPORT})
RESULTS = Kind("results file", folder=False, file_ok=lambda p: _schema(p) == "gqakit.eval/1")
KINDS = {k.name: k for k in (MODEL, RUN, REPORT, DEMO, RESULTS)}


def write_manifest(folder: Path, kind: Kind, entries: Iterable[str] | None = None) -> None:
    """Record that gqakit wrote FOLDER: its kind and every file in it, or `name/` for a
    part whose content the kind checks (`Kind.parts`)."""
    import gqakit

    if entries is None:
        entries = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    body = {"written_by": "gqakit", "gqakit": gqakit.__version__, "kind": kind.name,
            "entries": [e for e in entries if e != MANIFEST]}
    (folder / MANIFEST).write_text(json.dumps(body, indent=1) + "\n")


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
            foreign = _foreign(out, entries, kind)
        elif kind.legacy is not None and kind.legacy(out):
            foreign = _foreign(out, list(kind.entries), kind) if kind.entries else []
        else:
            return f"it was not written by gqakit (no {MANIFEST})"
        if foreign:
            return f"it holds {foreign[0]!r}, which gqakit did not write" + (
                f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else "")
        return None
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
        raise GqakitError(describe_oserror(e, out, [tmp])) from None
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
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        remove_if_empty(made)
        raise GqakitError(describe_oserror(e, out, [tmp])) from None
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
