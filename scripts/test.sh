#!/usr/bin/env bash
# Set up .venv if needed, then run the default test suite (slow and GPU tests are
# deselected; `scripts/test.sh -m slow` runs the slow ones). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
