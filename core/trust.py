"""Which Python code from a model folder or a tasks folder gqakit may run.

transformers runs Python code that a model folder carries when its `config.json` or
`tokenizer_config.json` has an `auto_map` naming a module file, and the loader passes
`trust_remote_code=True`. gqakit passes True only when

- every file the `auto_map` names is byte-identical (sha256) to a modeling file this
  version of gqakit ships (`convert/remote/gqakit_modeling_*.py`): gqakit's own code; or
- the user passed `--trust-remote-code` to the verb, which runs under `consent(True)`.

Otherwise a folder whose `auto_map` names a `gqakit_modeling_*` file is refused in one
line: the file claims to be gqakit's and is not (edited, or from another gqakit version).
Any other `auto_map` is left to transformers with `trust_remote_code=False`: a family it
knows loads with its own classes and the folder's code is ignored; a folder that only its
code can load is refused (`refusal`). The same consent covers the task files of
`eval --tasks-path`: a `!function` tag there imports Python (`check_task_folder`), and
without consent their Jinja templates render in Jinja's sandbox (`eval/tasks.py`).

The consent lives in a context variable set around one verb, so nothing outside that
verb (a test, the Python API, another thread) inherits it. This module imports nothing
heavy: the checks run before torch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

from gqakit.core.errors import GqakitError
from gqakit.core.files import file_sha256

FLAG = "--trust-remote-code"
REMOTE_PREFIX = "gqakit_modeling_"
# gqakit's own modeling files, read as package data (core never imports gqakit.convert).
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "convert" / "remote"
# The files whose `auto_map` transformers follows.
MAP_FILES = ("config.json", "tokenizer_config.json")
HELP = ("Allow Python code that comes with the input to run: the modules a model folder's config.json or "
        "tokenizer_config.json names in `auto_map`{extra}. Without it only gqakit's own modeling files run, and "
        "only when they are byte-identical to the ones this version of gqakit ships.")

_consent: ContextVar[bool] = ContextVar("gqakit_trust_remote_code", default=False)

F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def consent(allowed: bool) -> Iterator[None]:
    """Within the block, code from the input folders may run when ALLOWED (--trust-remote-code)."""
    token = _consent.set(bool(allowed))
    try:
        yield
    finally:
        _consent.reset(token)


def allowed() -> bool:
    """Whether the running verb was given --trust-remote-code."""
    return _consent.get()


def option(extra: str = "") -> Callable[[F], F]:
    """The `--trust-remote-code` click flag for a verb; the verb's body runs under `consent(flag)`.

    EXTRA is added to the help text (what else the flag allows on that verb)."""
    import click

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, trust_remote_code: bool = False, **kwargs: Any) -> Any:
            with consent(trust_remote_code):
                return fn(*args, **kwargs)

        return click.option("--trust-remote-code", "trust_remote_code", is_flag=True,
                            help=HELP.format(extra=extra))(run)  # type: ignore[return-value]

    return decorate


@functools.lru_cache(maxsize=1)
def shipped_hashes() -> frozenset[str]:
    """sha256 of every modeling file this version of gqakit ships."""
    return frozenset(file_sha256(p) for p in SHIPPED_DIR.glob(f"{REMOTE_PREFIX}*.py"))


def is_shipped(path: Path) -> bool:
    """PATH is a file byte-identical to one of gqakit's shipped modeling files."""
    try:
        return Path(path).is_file() and file_sha256(Path(path)) in shipped_hashes()
    except OSError:
        return False


def _refs(value: Any) -> list[str]:
    """Class references in one auto_map value: "module.Class", "repo--module.Class", or a
    [slow, fast] list of those (a tokenizer's), with None for a missing one."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in items if isinstance(v, str) and v]


def code_files(folder: Path) -> list[tuple[str, Path | None]]:
    """(reference, file) for each module an `auto_map` of FOLDER names. The file is None for
    a reference to another repository ("repo--module.Class"), which is never gqakit's."""
    folder = Path(folder)
    out: dict[str, Path | None] = {}
    for name in MAP_FILES:
        try:
            cfg = json.loads((folder / name).read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # absent or unreadable: the loaders' own checks name a broken file
        amap = cfg.get("auto_map") if isinstance(cfg, dict) else None
        if not isinstance(amap, dict):
            continue
        for value in amap.values():
            for ref in _refs(value):
                module = ref.rpartition(".")[0] or ref
                out.setdefault(ref, None if "--" in module else folder / f"{module}.py")
    return list(out.items())


def only_gqakit_code(files: list[tuple[str, Path | None]]) -> bool:
    """FILES (from `code_files`) are all byte-identical to gqakit's shipped modeling files."""
    return bool(files) and all(p is not None and is_shipped(p) for _, p in files)


def _describe(ref: str, path: Path | None) -> str:
    return str(path) if path is not None else f"{ref} (code from another repository)"


def refusal(folder: Path, files: list[tuple[str, Path | None]] | None = None) -> GqakitError:
    """One line naming the first file of FOLDER's code that needs --trust-remote-code."""
    files = code_files(folder) if files is None else files
    foreign = [(r, p) for r, p in files if p is None or not is_shipped(p)]
    foreign.sort(key=lambda rp: not (rp[1] is not None and rp[1].name.startswith(REMOTE_PREFIX)))  # claims first
    what = _describe(*foreign[0]) if foreign else f"the Python code of {folder}"
    claims = bool(foreign) and foreign[0][1] is not None and foreign[0][1].name.startswith(REMOTE_PREFIX)
    why = ("is not byte-identical to a modeling file this version of gqakit ships (edited, or from another "
           "version)" if claims else "is Python code that comes with the model, not gqakit's")
    return GqakitError(f"{what} {why}; loading the model would run it. gqakit runs it only with {FLAG}, "
                       f"after you have read it")


def check_folder(folder: Path) -> bool:
    """The `trust_remote_code` value to hand transformers for FOLDER (True: its code may run).

    Refuses, in one line, a folder whose `auto_map` names a `gqakit_modeling_*` file that is
    not gqakit's own, unless --trust-remote-code was given. Reads only small files."""
    files = code_files(folder)
    if not files:
        return False
    if only_gqakit_code(files) or allowed():
        return True
    if any(p is not None and p.name.startswith(REMOTE_PREFIX) and not is_shipped(p) for _, p in files):
        raise refusal(folder, files)
    return False


def needs_code(error: BaseException) -> bool:
    """transformers refused to load a folder because it needs its code (trust_remote_code)."""
    return "trust_remote_code" in str(error)


# YAML that makes the harness run Python: `!function module.fn` imports module.py (or any
# importable module); python/* tags name Python objects; %TAG can spell either indirectly.
CODE_TAGS = ("!function", "!!python", "tag:yaml.org,2002:python", "%TAG")


def task_code(folder: str | Path) -> list[tuple[Path, str]]:
    """(task file, tag) for every task file under FOLDER, or included by one, that would make
    the harness run Python code; read as text, so a file that does not parse still counts."""
    import yaml

    class Loader(yaml.SafeLoader):  # every tag parses as nothing: only `include` is read
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    found: list[tuple[Path, str]] = []
    todo = sorted(Path(folder).expanduser().rglob("*.y*ml"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop(0).resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        tag = next((t for t in CODE_TAGS if t in text), None)
        if tag:
            found.append((path, tag))
        try:
            cfg = yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader subclass)
        except yaml.YAMLError:
            continue
        inc = cfg.get("include") if isinstance(cfg, dict) else None
        for name in inc if isinstance(inc, list) else [inc]:
            if isinstance(name, str) and name:  # the harness reads includes relative to the file
                todo.append(Path(name) if Path(name).is_absolute() else path.parent / name)
    return found


def check_task_folder(folder: str | Path) -> None:
    """Refuse, in one line, a tasks folder whose task files would import Python code,
    unless the verb was given --trust-remote-code."""
    if allowed():
        return
    found = task_code(folder)
    if found:
        path, tag = found[0]
        more = f" (and {len(found) - 1} more task files)" if len(found) > 1 else ""
        raise GqakitError(f"task file {path}{more} has a {tag} tag, which makes lm-evaluation-harness import and "
                          f"run Python code from {path.parent}; gqakit runs it only with {FLAG}, after you "
                          f"have read it")
