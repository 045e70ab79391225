"""YAML from the user, read within limits: file size, alias expansion and nesting.

PyYAML's safe loader builds only plain types, but an alias refers to a node instead of
copying it, so ten lines of anchors can stand for a billion values. Loading such a file is
quick; everything that walks the result afterwards (overrides, validation, a copy) is not,
and runs until memory is gone. Here the composed document is measured before anything is
built from it: its size once every alias is expanded, its depth, and whether an alias
points into itself. A config is a few hundred values, so the limits are far above any
real file and far below a harmful one.

Every failure is one `YamlError` line naming the file, and for bad syntax the line and
column (1-based, as editors count) where PyYAML stopped (a `GqakitError`, and a
`ValueError` for readers that skip what they cannot use).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gqakit.core.errors import GqakitError, first_line

MAX_BYTES = 8 << 20
MAX_VALUES = 100_000  # scalars, lists and mappings, aliases counted at their expanded size
MAX_DEPTH = 100


class YamlError(GqakitError, ValueError):
    """A YAML file or value gqakit will not use; the message names it."""


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _measure(root: yaml.Node, what: str) -> None:
    """Refuse a document whose aliases expand past MAX_VALUES, that nests deeper than
    MAX_DEPTH, or that holds itself; each distinct node is visited once."""
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        k = id(node)
        if done:
            open_.discard(k)
            kids = _children(node)
            size[k] = 1 + sum(size[id(c)] for c in kids)
            height[k] = 1 + max((height[id(c)] for c in kids), default=0)
            if size[k] > MAX_VALUES:
                raise YamlError(f"{what}: its aliases expand to more than {MAX_VALUES:,} values (a YAML alias "
                                "bomb?); write the values out instead")
            if height[k] > MAX_DEPTH:
                raise YamlError(f"{what}: nested more than {MAX_DEPTH} levels deep")
            continue
        if k in size:
            continue
        if k in open_:
            raise YamlError(f"{what}: an alias refers to a value that contains it (a recursive YAML structure)")
        open_.add(k)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)


def load_yaml_text(text: str, what: str) -> Any:
    """Parse TEXT with PyYAML's safe types, within the limits above.

    Bad syntax raises `yaml.YAMLError` (the caller words it); a limit raises `YamlError`
    naming WHAT."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node, what)
        return loader.construct_document(node)
    except RecursionError:
        raise YamlError(f"{what}: nested too deeply") from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file a user gave gqakit; every problem is one `YamlError` naming the file."""
    path = Path(path).expanduser()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise YamlError(f"cannot read {path}: {e.strerror or e}") from None
    if len(raw) > MAX_BYTES:
        raise YamlError(f"{path} is larger than {MAX_BYTES >> 20} MiB; a YAML file gqakit reads may be at most that")
    try:
        return load_yaml_text(raw.decode("utf-8"), str(path))
    except UnicodeDecodeError:
        raise YamlError(f"{path} is not valid YAML: not UTF-8 text (a binary or damaged file?)") from None
    except yaml.YAMLError as e:
        raise YamlError(f"{path} is not valid YAML: {syntax_error(e)}") from None


def syntax_error(e: yaml.YAMLError) -> str:
    """PyYAML's error as one phrase with where it is: `line 3, column 7: mapping values are
    not allowed here`, and where the construct it was reading began, when PyYAML says."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or not problem:
        return first_line(e, None)
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and cmark is not None and (cmark.line, cmark.column) != (mark.line, mark.column):
        text += f" ({context} that starts at line {cmark.line + 1}, column {cmark.column + 1})"
    elif context:
        text += f" ({context})"
    return text
