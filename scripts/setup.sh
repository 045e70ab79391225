#!/usr/bin/env bash
# Create (or reuse) .venv and install gqakit into it, editable, with test extras.
# torch is pinned to a CPU build, torch==2.13.0 (TORCH_SPEC overrides it, e.g.
# TORCH_SPEC=torch for a CUDA build); an already-installed torch >= 2.4 is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "${TORCH_SPEC:-torch==2.13.0}"
fi
if ! .venv/bin/python -c 'import gqakit.cli, pytest' 2>/dev/null || [ pyproject.toml -nt .venv/.gqakit-installed ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
  touch .venv/.gqakit-installed
fi
