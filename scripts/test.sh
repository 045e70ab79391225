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
# the tests in worker processes (pytest-xdist), one per core up to 4, each file on one worker (its
# module fixtures built once); the engine tests in this process (each engine takes the machine's
# memory for its cache); GQAKIT_TEST_WORKERS overrides the count (0: in this process)
case " $* " in
  *engines*) DEFAULT_WORKERS=0 ;;
  *) DEFAULT_WORKERS=$(n=$(nproc 2>/dev/null || echo 1); echo $(( n < 4 ? n : 4 ))) ;;
esac
WORKERS=${GQAKIT_TEST_WORKERS:-$DEFAULT_WORKERS}
.venv/bin/python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
if [ $# -eq 0 ] && [ "$(uname -m)" = x86_64 ]; then
  ATEN_CPU_CAPABILITY=avx2 .venv/bin/python -m pytest -q -m "numerics and not slow and not gpu and not engines"
fi
