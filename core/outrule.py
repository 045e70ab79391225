"""The output rule: where gqakit may write, and which existing outputs it may replace.

Applied by every verb before it writes or deletes anything:
  1. An output may never be, contain, or sit inside any input of the same command
     (model, teacher, data files, eval file, results files, the config itself).
  2. An existing output is replaced only with `--overwrite`, and only when gqakit wrote
     it: a folder must carry gqakit's manifest (`.gqakit-output.json`, which lists every
     file gqakit put there, or names a part whose content its kind checks) and hold
     nothing else at any depth; a results file must be a gqakit results JSON. Anything
     else is refused, with or without `--overwrite`.
  3. The caller deletes nothing until every other check of the command has passed.

`core.outdir` writes the outputs this rule allows. This module imports nothing heavy:
the checks run before torch is imported.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gqakit.core.errors import GqakitError

TMP_MARK = ".gqakit-tmp-"
MANIFEST = ".gqakit-output.json"

# (label, path): what an input is called in messages, and where it is.
Inputs = Sequence[tuple[str, "str | Path | None"]]


# ----------------------------------------------------------------------------- kinds of output


def read_json(path: Path) -> object:
    """The JSON value in PATH, or None when it cannot be read or parsed."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _schema(path: Path) -> str | None:
    data = read_json(path)
    return data.get("schema") if isinstance(data, dict) else None


@dataclass(frozen=True)
class Kind:
    """One kind of output: a folder (with a manifest) or a single file."""

    name: str                                   # in messages: "model folder", "uptrain run", ...
    folder: bool = True
    file_ok: Callable[[Path], bool] | None = None  # file kinds: is this file one gqakit wrote?
    # A manifest entry `name/` covers a sub-folder only as far as its part says: another kind
    # of output (with its own manifest), or a function listing what in it gqakit did not write.
    parts: Mapping[str, "Kind | Callable[[Path], list[str]]"] = field(default_factory=dict)


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
        man = read_json(sub / MANIFEST)
        entries = man.get("entries") if isinstance(man, dict) and man.get("written_by") == "gqakit" else None
        if isinstance(man, dict) and man.get("kind") == part.name and isinstance(entries, list) and all(
                isinstance(e, str) for e in entries):
            return _foreign(sub, entries, part)
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
        if _STEP_TEMP.fullmatch(top) and rel != top:  # a folder, even an empty one
            continue
        if _STEP.fullmatch(top) and inner:
            record = read_json(folder / top / CHECKPOINT_RECORD)
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


MODEL = Kind("model folder")
RUN = Kind("uptrain run", parts={CHECKPOINTS: _foreign_checkpoints, "model": MODEL, "uptrain": _foreign_tensorboard})
REPORT = Kind("compare report")
DEMO = Kind("demo folder", parts={"converted": MODEL, "mean": MODEL, "uptrain": RUN, "results": _foreign_results,
                                  "report": REPORT})
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
        man = read_json(out / MANIFEST)
        if isinstance(man, dict) and man.get("written_by") == "gqakit":
            if man.get("kind") != kind.name:
                return f"it is a gqakit {man.get('kind')}, not a {kind.name}"
            entries = man.get("entries")
            if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
                return f"its manifest {MANIFEST} is damaged"
            foreign = _foreign(out, entries, kind)
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
    """Rule 1: OUT is not, does not contain, and does not sit inside any input (and is not `-`,
    which would name a file `-`, not standard output)."""
    if str(out) == "-":
        raise GqakitError(f"{flag} is '-': gqakit writes to a path, not to standard output; name a file or folder")
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
