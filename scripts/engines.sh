#!/usr/bin/env bash
# Install a serving engine that `gqakit eval --engine NAME` and the `engines` tests use.
#
#   bash scripts/engines.sh llama.cpp   # llama-cpp-python into .venv (compiles llama.cpp once)
#   bash scripts/engines.sh vllm        # vLLM in its own venv, .venv-vllm
#
# PYTHON: the interpreter to install into (default .venv/bin/python, made by scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WHEELS=${GQAKIT_WHEELS:-$HOME/.cache/gqakit/wheels}

llamacpp() {
  # llama-cpp-python is an sdist: pip compiles llama.cpp with cmake and a C++ compiler (about
  # 20 minutes on 2 cores). The built wheel is kept in $WHEELS and installed from there next time.
  local version=0.3.36
  if "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null; then
    echo "llama-cpp-python $version is installed"
    return
  fi
  local wheel
  wheel=$(ls "$WHEELS"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    command -v cmake >/dev/null || "$PY" -m pip install -q --disable-pip-version-check cmake
    mkdir -p "$WHEELS"
    "$PY" -m pip wheel --no-deps --disable-pip-version-check -w "$WHEELS" "llama-cpp-python==$version"
    wheel=$(ls "$WHEELS"/llama_cpp_python-"$version"-*.whl | head -n 1)
  fi
  "$PY" -m pip install -q --disable-pip-version-check "$wheel"
  "$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
}

vllm() {
  echo "vllm: not part of this script yet" >&2
  exit 2
}

case "${1:-}" in
  llama.cpp|llamacpp) llamacpp ;;
  vllm) vllm ;;
  *) echo "usage: bash scripts/engines.sh llama.cpp|vllm" >&2; exit 2 ;;
esac
