"""Module dependency rules (docs/design.md), checked on the source: every import, including
the function-level ones, so a cycle cannot hide behind a lazy import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# stage -> the gqakit packages it may import; the package root (cli.py, demo.py) may import all
ALLOWED = {
    "core": {"core"},
    "convert": {"core", "convert"},
    "uptrain": {"core", "uptrain"},
    "eval": {"core", "eval"},
}


def gqakit_imports(path: Path) -> set[str]:
    """Dotted names under `gqakit.` that the file imports at run time (type-checking-only
    imports aside), without the `gqakit.` prefix."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n.removeprefix("gqakit.") for n in names if n.startswith("gqakit.")}
    return out


@pytest.mark.parametrize("stage", sorted(ALLOWED))
def test_stages_import_only_what_they_may(stage):
    bad = {}
    for path in sorted((ROOT / stage).rglob("*.py")):
        used = {name.split(".")[0] for name in gqakit_imports(path)}
        if used - ALLOWED[stage]:
            bad[str(path.relative_to(ROOT))] = sorted(used - ALLOWED[stage])
    assert not bad, f"{stage} may import only gqakit.{{{', '.join(sorted(ALLOWED[stage]))}}}: {bad}"


def convert_imports(path: Path) -> set[str]:
    """The `gqakit.convert` modules a file imports, TYPE_CHECKING and function-level imports
    included, as dotted names under `convert.` (a name imported from a module counts as the module)."""
    tree = ast.parse(path.read_text())
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in (ROOT / "convert").rglob("*.py")}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name.removeprefix("gqakit.") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module.removeprefix("gqakit.")
            names = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def convert_graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "convert").rglob("*.py"))
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): convert_imports(p)
            for p in files}


def test_convert_has_no_import_cycle_counting_lazy_imports():
    graph = convert_graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(node):] + [node])}")
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, path + [node])
        done.add(node)

    for module in graph:
        visit(module, [])


def test_convert_layers():
    graph = convert_graph()

    def reach(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    # the math is pure: it imports only itself (and core), never IO, settings or stages
    math = {"convert.layout", "convert.align", "convert.pooling", "convert.grouping", "convert.methods"}
    for m in math:
        assert graph[m] <= math, f"{m} imports {sorted(graph[m] - math)}"
    # grouping uses only the head math
    assert graph["convert.grouping"] <= {"convert.align", "convert.layout"}
    # the calibration package never reaches the pipeline (the pipeline runs the stage)
    calibration = [m for m in graph if m.startswith("convert.calibration")]
    assert len(calibration) > 3
    for m in calibration:
        assert "convert.pipeline" not in reach(m), m
    assert not any(d.startswith("convert.calibration") for m in math for d in graph[m])
    # the settings import no torch-heavy module at import time (the CLI checks before torch loads)
    assert not {n.split(".")[0] for n in gqakit_imports(ROOT / "convert" / "settings.py")} - {"core", "convert"}


def test_decode_never_imports_speed():
    """eval/decode (attention, packed weights, fused layers, kernels) is used by the speed
    benchmark and knows nothing of it."""
    bad = {str(p.relative_to(ROOT)): sorted(n for n in gqakit_imports(p) if n.startswith("eval.speed"))
           for p in sorted((ROOT / "eval" / "decode").rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}
    assert (ROOT / "eval" / "decode" / "layers.py").is_file()  # the rule looks where the package is
