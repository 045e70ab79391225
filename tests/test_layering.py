"""Module dependency rules (docs/design.md), checked on the source: every import, including
the function-level ones, so a cycle cannot hide behind a lazy import."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# stage -> the gqakit packages it may import; the package root (cli.py, demo.py) may import all
ALLOWED = {
    "core": {"core"},
    "convert": {"core", "convert"},
    "uptrain": {"core", "uptrain"},
    "eval": {"core", "eval"},
    "engines": {"core", "engines", "runtime"},
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


# The whole product: every module, lazy and TYPE_CHECKING imports included.

def product_modules() -> dict[str, Path]:
    """Dotted module name (without `gqakit.`) -> file, for every product module."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {"tests", "bench", "build", "examples"} or rel.parts[0].startswith(".") \
                or "remote" in rel.parts:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts) or "__init__"] = path
    return out


def _resolve_relative(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    base = module.split(".") if module != "__init__" else []
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports_of(path: Path, module: str = "") -> frozenset[tuple[str, tuple[str, ...]]]:
    """(dotted module without `gqakit.`, names imported from it) for every gqakit import in
    the file, wherever it stands (top level, function, TYPE_CHECKING block)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gqakit."):
                    out.add((a.name.removeprefix("gqakit."), ()))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = _resolve_relative(module, node, path.name == "__init__.py")
            elif node.module and (node.module == "gqakit" or node.module.startswith("gqakit.")):
                mod = node.module.removeprefix("gqakit").removeprefix(".")
            else:
                continue
            out.add((mod, tuple(a.name for a in node.names)))
    return frozenset(out)


def module_deps(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules `module` imports (a `from pkg import sub` counts as pkg.sub)."""
    deps = set()
    for mod, names in imports_of(path, module):
        for name in names:
            full = f"{mod}.{name}" if mod else name
            if full in modules:
                deps.add(full)
        if mod in modules:
            deps.add(mod)
    deps.discard(module)
    return deps


def test_no_import_cycle_counting_lazy_imports():
    modules = product_modules()
    graph = {m: module_deps(m, p, modules) for m, p in modules.items()}
    # packages' __init__ re-exports are edges too, but a package importing its own submodule is not a cycle
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_another_modules_private_names():
    modules = product_modules()
    bad = []
    for module, path in modules.items():
        for mod, names in imports_of(path, module):
            bad += [f"{module}: from gqakit.{mod} import {n}" for n in names
                    if n.startswith("_") and not n.startswith("__") and mod != module]
    assert not bad, bad


def test_bench_uses_only_public_names():
    bad = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for mod, names in imports_of(path):
            bad += [f"bench/{path.relative_to(ROOT / 'bench')}: from gqakit.{mod} import {n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
        text = path.read_text()
        assert "sys.path.insert" not in text and "sys.path.append" not in text, \
            f"{path.name}: bench scripts run as `python -m bench.NAME`, without sys.path changes"
    assert not bad, bad


def test_tests_never_import_or_run_bench():
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.name}: import {n}" for n in names if n == "bench" or n.startswith("bench.")]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and (node.value == "bench" or node.value.startswith(("bench/", "bench."))):
                bad.append(f"{path.name}: {node.value!r}")
    assert not bad, f"tests use bench/ (test a bench script beside it, in bench/): {bad}"


def test_product_modules_stay_under_500_lines():
    long = {m: n for m, p in product_modules().items() if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines (split by job): {long}"
