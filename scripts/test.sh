#!/usr/bin/env bash
# Set up .venv if needed, then run the default test suite (slow, GPU and engine tests are
# deselected; `scripts/test.sh -m slow` runs the slow ones, `scripts/test.sh -m engines` the
# ones that serve outputs in vLLM and llama.cpp, after `bash scripts/engines.sh all`). Extra
# args go to pytest.
# With no args, the numerical tests (marker `numerics`: two computations summing in other
# orders) run a second time on ATen's AVX2 kernels, which every x86-64 CI machine has, so a
# tolerance that holds only for one processor's kernels fails here first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest -q "$@"
if [ $# -eq 0 ] && [ "$(uname -m)" = x86_64 ]; then
  ATEN_CPU_CAPABILITY=avx2 .venv/bin/python -m pytest -q -m "numerics and not slow and not gpu and not engines"
fi
