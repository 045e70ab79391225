"""Glob patterns expanded within a budget, for patterns gqakit reads from files it did not write.

A pattern the user types (`data.files` of an uptrain config) is expanded by `glob.glob`
as it stands. A pattern read back from a model folder's records (`gqakit_uptrain.yaml` of
a downloaded model) is not the user's: `/**/*.txt` there would walk the whole
filesystem. `bounded_glob` expands such a pattern by looking at no more than
`max_entries` directory entries, never following a symlinked folder, and says whether it
finished.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from pathlib import Path

MAX_ENTRIES = 10_000


class _OverBudget(Exception):
    pass


def bounded_glob(pattern: str, max_entries: int = MAX_ENTRIES) -> tuple[list[str], bool]:
    """(the files PATTERN matches, sorted; True when the walk finished within MAX_ENTRIES
    directory entries). A pattern without wildcards is a literal path (no walk at all)."""
    path = os.path.expanduser(pattern)
    if not glob.has_magic(path):
        return ([path] if os.path.isfile(path) else []), True
    parts = Path(path).parts
    first = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    root = str(Path(*parts[:first])) if first else ""
    budget = [max_entries]
    found: list[str] = []

    listed: dict[str, list[os.DirEntry]] = {}

    def entries(folder: str) -> list[os.DirEntry]:
        """FOLDER's entries, each folder listed once and counted against the budget."""
        if folder not in listed:
            out: list[os.DirEntry] = []
            try:
                with os.scandir(folder or ".") as it:
                    for e in it:
                        budget[0] -= 1
                        if budget[0] < 0:
                            raise _OverBudget
                        out.append(e)
            except OSError:
                pass
            listed[folder] = out
        return listed[folder]

    def walk(folder: str, rest: tuple[str, ...]) -> None:
        part, tail = rest[0], rest[1:]
        if part == "**":
            walk_tail = tail or ("*",)
            walk(folder, walk_tail)
            for e in entries(folder):
                if e.is_dir(follow_symlinks=False) and not e.name.startswith("."):
                    walk(e.path, rest)
            return
        if not glob.has_magic(part):
            nxt = os.path.join(folder, part)
            if not tail:
                if os.path.isfile(nxt):
                    found.append(nxt)
            elif os.path.isdir(nxt):
                walk(nxt, tail)
            return
        for e in entries(folder):
            if e.name.startswith(".") and not part.startswith(".") or not fnmatch.fnmatchcase(e.name, part):
                continue
            if not tail:
                if e.is_file():
                    found.append(e.path)
            elif e.is_dir(follow_symlinks=False):
                walk(e.path, tail)

    try:
        walk(root, parts[first:])
        done = True
    except _OverBudget:
        done = False
    return sorted(set(found)), done
