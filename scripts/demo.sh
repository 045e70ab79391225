#!/usr/bin/env bash
# Set up .venv if needed, then run the embedded demo end to end:
# convert SmolLM2-135M (3 -> 1 KV heads), uptrain briefly, evaluate, write the report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/gqakit demo "$@"
