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


def test_convert_has_no_import_cycle_between_methods_and_calibration():
    def uses(module: str) -> set[str]:
        return {n for n in gqakit_imports(ROOT / "convert" / f"{module}.py") if n.startswith("convert.")}

    assert not any(n.startswith("convert.calibrate") for n in uses("methods"))
    assert not any(n.startswith(("convert.methods", "convert.pipeline")) for n in uses("calibrate"))
    # grouping uses only the head math
    assert {n.rsplit(".", 1)[0] if n.count(".") > 1 else n for n in uses("grouping")} <= {"convert.align",
                                                                                          "convert.layout"}


def test_decode_never_imports_speed():
    """eval/decode (attention, packed weights, fused layers, kernels) is used by the speed
    benchmark and knows nothing of it."""
    bad = {str(p.relative_to(ROOT)): sorted(n for n in gqakit_imports(p) if n.startswith("eval.speed"))
           for p in sorted((ROOT / "eval" / "decode").rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}
    assert (ROOT / "eval" / "decode" / "layers.py").is_file()  # the rule looks where the package is
