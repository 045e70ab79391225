"""Every pytest marker the tests use is registered in pyproject.toml, with a name that says
what the test needs (not where the project keeps it)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILTIN = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}


def registered() -> set[str]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {m.split(":", 1)[0].strip() for m in cfg["tool"]["pytest"]["ini_options"]["markers"]}


def test_markers_used_are_registered():
    files = [*REPO.glob("tests/**/*.py"), *REPO.glob("*/tests/**/*.py")]  # both test folders, no environment
    used = {m for f in files for m in re.findall(r"pytest\.mark\.(\w+)", f.read_text())}
    assert used - BUILTIN <= registered(), used - BUILTIN - registered()
    assert "assets" in used  # the tests that need the real models and data say so


def test_no_marker_is_named_after_a_folder():
    assert "shared" not in registered()
