#!/usr/bin/env bash
# Fill .whl/ with the wheels bench/gpu_proof.sh needs on a GPU image that lacks them.
#
#   bash bench/gpu_wheels.sh          # here, where PyPI is reachable; then bring .whl/ along
#
# The GPU image (see docs/benchmarks.md) has torch, transformers, accelerate, click,
# pyyaml, safetensors, tokenizers and tqdm, but not pydantic, which gqakit's config and
# architecture tables validate with, nor gguf, which reads the SmolLM2 GGUF
# (bench/gpu_recover.py). The versions are the ones installed in .venv (a set
# that pip resolved together), built for CPython 3.12 on x86-64 Linux, the GPU image's
# Python. `datasets` is not needed: uptrain reads plain text without it.
# .whl/ is git-ignored; gpu_proof.sh installs what is in it (pip --no-index --no-deps)
# into its scratch folder only when a module is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PYVER=${WHEEL_PYTHON_VERSION:-3.12}
SPECS=$("$PY" -c 'import importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in ["pydantic", "pydantic-core", "annotated-types",
                                                "typing-inspection", "typing-extensions", "gguf"]))')
mkdir -p .whl
echo "downloading $SPECS for CPython $PYVER, manylinux x86_64, into .whl/" >&2
# shellcheck disable=SC2086
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $SPECS
ls -l .whl >&2
