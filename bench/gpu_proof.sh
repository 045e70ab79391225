#!/usr/bin/env bash
# All of gqakit's GPU measurements in one go, sized for one call of an H100 machine
# (about 9 minutes, no internet, no ../shared: models and text are built in code).
#
#   bash bench/gpu_proof.sh OUTDIR              # on a GPU machine; OUTDIR defaults to $OUT
#   bash bench/gpu_proof.sh --dry-run OUTDIR    # pico sizes on the CPU, same code paths (the tests run it)
#
# Steps, each its own process under its own time limit (`timeout`): a step that fails or
# runs out of time is recorded and the next one still runs, and each step writes its
# results as it goes, so a step stopped early keeps what it measured.
#   1. convert  random 7B-shaped bf16 checkpoint -> `gqakit convert -g 8 --method align-refit
#               --device cuda`, 131,072 calibration tokens: wall time, peak GPU memory against
#               2 x one block + the streams, residual drift (bench/gpu_convert.py) -> convert.json
#   2. decode   MHA vs GQA decode speed, Llama-2-7B shape (32 vs 8 vs 4 KV heads), bf16,
#               batch x prompt grid with memory-bound points; measured vs predicted-by-bytes
#               speedup (bench/bench_decode.py)                                 -> decode.json
#   3. uptrain  `gqakit uptrain`, 50 steps, random 1.1B Llama-shaped GQA model, bf16
#               mixed precision: tokens/s and MFU from its log.jsonl           -> uptrain.json
#   4. recover  only when GQAKIT_SMOLLM2 names the SmolLM2 GGUF (and ../shared is beside the
#               checkout): SmolLM2 G=1 from the recommended align-refit start, uptrained
#               until within 10% of the original (bench/gpu_recover.py), under its own limit
#               GQAKIT_RECOVER_LIMIT_S (default 3600), outside the budget -> recover.json
#   6. refit    align-refit at its defaults (--effort best, 65,536 tokens) on a 2-layer Llama-2-7B-
#               shaped checkpoint: seconds per layer, the 32-layer projection against a 20-minute
#               target, the --dry-run estimate against the measured time (bench/gpu_refit.py) -> refit.json
#   5. decode-compiled  only when GQAKIT_PROOF_STEPS names it (a call of its own: it needs
#               minutes of compiling): the models of step 2 with the decode step compiled
#               (torch.compile, mode reduce-overhead: fused small kernels + CUDA graphs, the
#               gpt-fast recipe), batch 1 and 16 at 2,048 tokens, MHA against 8 KV heads
#                 GQAKIT_PROOF_STEPS=decode-compiled bash bench/gpu_proof.sh OUTDIR -> decode_compiled.json
#   7. vllm     when vLLM is importable (.venv-vllm, $GQAKIT_VLLM_PYTHON or this python) and
#               GQAKIT_SMOLLM2 names the SmolLM2 GGUF: gqakit's serving check in vLLM on CUDA for
#               SmolLM2 G=3 and G=1 (folders made from the GGUF), and the capacity bench at a fixed
#               KV budget (bench/gpu_vllm.py), under its own limit GQAKIT_VLLM_LIMIT_S (default 600),
#               outside the budget; without vLLM one line says so and the step is skipped -> vllm.json
# Then OUTDIR/gpu_proof.json (everything) and OUTDIR/gpu_proof.md (a snippet for
# docs/benchmarks.md), with OUTDIR/log.txt (all output) and OUTDIR/steps.tsv (exit codes).
#
# Python: $PYTHON, else .venv/bin/python, else python3. If gqakit is not installed there,
# this checkout is put on PYTHONPATH as `gqakit`. Missing dependencies (a GPU image may
# lack pydantic) are installed from .whl/ into the scratch folder when .whl/ has wheels:
# `bash bench/gpu_wheels.sh` fills it on a machine that reaches PyPI.
# Environment: GQAKIT_PROOF_BUDGET_S (seconds for all steps; default 560 on a GPU),
# GQAKIT_PROOF_WORK (scratch folder for models and text; default a new temporary one,
# removed at the end; the GPU run needs about 30 GB of disk there at most),
# GQAKIT_PROOF_COMMIT (the commit to record where the checkout has no .git),
# GQAKIT_PROOF_CACHE (gqakit's cache: the built CPU kernels and tokenized data; default WORK/cache),
# GQAKIT_SMOLLM2, GQAKIT_RECOVER_LIMIT_S, GQAKIT_VLLM_LIMIT_S, GQAKIT_RECOVER_TOKENS (step 4; default 50,000,000 tokens),
# GQAKIT_PROOF_STEPS (the steps to run, e.g. "decode-compiled" or "convert decode"; default
# "convert decode uptrain refit recover vllm"; the others are recorded as skipped).
set -uo pipefail

usage() { echo "usage: bash bench/gpu_proof.sh [--dry-run] [OUTDIR]   (OUTDIR defaults to \$OUT)" >&2; exit 2; }
PROFILE=gpu
OUTDIR=
for arg in "$@"; do
  case "$arg" in
    --dry-run) PROFILE=dry ;;
    -h|--help) sed -n '2,50p' "$0"; exit 0 ;;
    -*) usage ;;
    *) [ -z "$OUTDIR" ] || usage; OUTDIR=$arg ;;
  esac
done
OUTDIR=${OUTDIR:-${OUT:-}}
[ -n "$OUTDIR" ] || usage
# the steps asked for, checked before anything is written or removed
ALL_STEPS="convert decode uptrain refit decode-compiled recover vllm"
SELECTED=" ${GQAKIT_PROOF_STEPS:-convert decode uptrain refit recover vllm} "
SELECTED=${SELECTED//,/ }
for s in $SELECTED; do
  case " $ALL_STEPS " in *" $s "*) ;; *) echo "gpu_proof.sh: unknown step '$s' in GQAKIT_PROOF_STEPS (steps: $ALL_STEPS)" >&2; exit 2 ;; esac
done
selected() { case " $SELECTED " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

cd "$(dirname "$0")/.."
REPO=$(pwd)
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
rm -f "$OUTDIR"/{decode,decode_compiled,uptrain,convert,refit,recover,vllm,vllm_check_g3,vllm_check_g1,vllm_capacity,gpu_proof}.json "$OUTDIR"/recover.png "$OUTDIR"/gpu_proof.md "$OUTDIR"/steps.tsv
LOG=$OUTDIR/log.txt
: > "$LOG"

if [ "$PROFILE" = gpu ]; then
  # convert (the least predictable step) runs first with the largest share;
  # the later steps get what is left, at most their own limit.
  BUDGET=${GQAKIT_PROOF_BUDGET_S:-560}; LIMIT_CONVERT=380; LIMIT_DECODE=120; LIMIT_UPTRAIN=90; LIMIT_DECODE_COMPILED=540; LIMIT_REFIT=300
else
  BUDGET=${GQAKIT_PROOF_BUDGET_S:-300}; LIMIT_DECODE=100; LIMIT_UPTRAIN=100; LIMIT_CONVERT=100; LIMIT_DECODE_COMPILED=150; LIMIT_REFIT=100
fi
START=$(date +%s)
DEADLINE=$((START + BUDGET))

if [ -n "${GQAKIT_PROOF_WORK:-}" ]; then
  WORK=$GQAKIT_PROOF_WORK; mkdir -p "$WORK"
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gqakit-proof.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
fi

say() { echo "[gpu_proof.sh $(date +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }

# ---- Python and its environment
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export GQAKIT_CACHE=${GQAKIT_PROOF_CACHE:-$WORK/cache}  # (its tests share one, so the kernels build once)
export GQAKIT_PROOF_COMMIT=${GQAKIT_PROOF_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if ! "$PY" -c 'import gqakit' 2>/dev/null; then
  mkdir -p "$WORK/pypath" && ln -sfn "$REPO" "$WORK/pypath/gqakit"
  export PYTHONPATH=$WORK/pypath${PYTHONPATH:+:$PYTHONPATH}
  say "gqakit is not installed for $PY: using this checkout through PYTHONPATH"
fi
missing() {
  "$PY" -c 'import importlib.util as u
print(" ".join(m for m in ["torch", "transformers", "accelerate", "safetensors", "tokenizers", "click",
                           "pydantic", "yaml", "tqdm", "numpy"] if u.find_spec(m) is None))'
}
MISSING=$(missing)
if [ -n "$MISSING" ] && compgen -G ".whl/*.whl" >/dev/null; then
  say "missing: $MISSING; installing the wheels in .whl/ into $WORK/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl 2>&1 | tee -a "$LOG"
  export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
  MISSING=$(missing)
fi
[ -z "$MISSING" ] || say "still missing: $MISSING (steps that need them will fail; run bench/gpu_wheels.sh where PyPI is reachable and bring .whl/ along)"

say "profile $PROFILE, budget ${BUDGET}s, python $PY, commit $GQAKIT_PROOF_COMMIT, out $OUTDIR, work $WORK"
if [ "$PROFILE" = gpu ]; then  # (each step's JSON records versions too; this is for the log)
  { "$PY" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "| torch", torch.__version__,
    "| transformers", transformers.__version__, "| cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  } 2>&1 | tee -a "$LOG"
fi

# ---- one step: NAME LIMIT_S COMMAND...; the limit is cut to what is left of the budget
run_step() {
  local name=$1 limit=$2; shift 2
  if ! selected "$name"; then
    say "step $name: skipped, not in GQAKIT_PROOF_STEPS"
    printf '%s\t-2\t0\t%s\n' "$name" "$limit" >> "$OUTDIR/steps.tsv"
    return
  fi
  local left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    say "step $name: not run, no time left in the ${BUDGET}s budget"
    printf '%s\t-1\t0\t%s\n' "$name" "$limit" >> "$OUTDIR/steps.tsv"
    return
  fi
  say "step $name: limit ${limit}s: $*"
  local t0 rc
  t0=$(date +%s.%N)
  timeout --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  local wall
  wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$wall" "$limit" >> "$OUTDIR/steps.tsv"
  say "step $name: exit $rc after ${wall}s"
  rm -rf "$WORK"/uptrain-* "$WORK"/convert-*  # a killed step leaves its models behind
}

COMMON=(--profile "$PROFILE" --out "$OUTDIR" --work "$WORK")
run_step convert "$LIMIT_CONVERT" "$PY" -m bench.gpu_convert "${COMMON[@]}"
run_step decode "$LIMIT_DECODE" "$PY" -m bench.gpu_proof decode "${COMMON[@]}"
run_step uptrain "$LIMIT_UPTRAIN" "$PY" -m bench.gpu_proof uptrain "${COMMON[@]}"
run_step refit "$LIMIT_REFIT" "$PY" -m bench.gpu_refit "${COMMON[@]}"
run_step decode-compiled "$LIMIT_DECODE_COMPILED" "$PY" -m bench.gpu_proof decode-compiled "${COMMON[@]}"
# 4. recover: only with the SmolLM2 GGUF and ../shared's WikiText-2 at hand
#    (GQAKIT_SMOLLM2 and ../shared beside the checkout), under its own limit, outside the budget above
if ! selected recover; then
  printf 'recover\t-2\t0\t0\n' >> "$OUTDIR/steps.tsv"
  say "step recover: skipped, not in GQAKIT_PROOF_STEPS"
elif [ -n "${GQAKIT_SMOLLM2:-}" ] && [ -f "$GQAKIT_SMOLLM2" ]; then
  DEADLINE=$(( $(date +%s) + ${GQAKIT_RECOVER_LIMIT_S:-3600} ))
  run_step recover "${GQAKIT_RECOVER_LIMIT_S:-3600}" "$PY" -m bench.gpu_recover --source "$GQAKIT_SMOLLM2" \
    --out "$OUTDIR" --work "$WORK/recover" ${GQAKIT_RECOVER_TOKENS:+--tokens $GQAKIT_RECOVER_TOKENS} \
    $([ "$PROFILE" = dry ] && echo --dry)
else
  printf '{"status": "skipped: GQAKIT_SMOLLM2 does not name the SmolLM2 GGUF (bench/gpu_recover.py)"}\n' > "$OUTDIR/recover.json"
  printf 'recover\t0\t0\t0\n' >> "$OUTDIR/steps.tsv"
  say "step recover: skipped (set GQAKIT_SMOLLM2 to the SmolLM2 GGUF to run bench/gpu_recover.py)"
fi

# 7. vllm: bench/gpu_vllm.py says in one line when vLLM is not importable (or the GGUF is not
#    given) and exits 0; otherwise it runs under its own limit, outside the budget above
if selected vllm; then
  DEADLINE=$(( $(date +%s) + ${GQAKIT_VLLM_LIMIT_S:-600} ))
  run_step vllm "${GQAKIT_VLLM_LIMIT_S:-600}" "$PY" -m bench.gpu_vllm "${COMMON[@]}"
else
  run_step vllm 0 true
fi

# ---- summary: gpu_proof.json + gpu_proof.md from what the steps wrote
say "summary after $(( $(date +%s) - START ))s"
if "$PY" -m bench.gpu_proof summary --profile "$PROFILE" --out "$OUTDIR" 2>&1 | tee -a "$LOG"; then
  echo; cat "$OUTDIR/gpu_proof.md"
else
  say "summary failed; step exit codes (name, exit, seconds, limit):"; cat "$OUTDIR/steps.tsv" >&2
  exit 1
fi
# Exit 0 only when every step finished ("ok" or "skipped: ..."): a failure is recorded, not hidden.
"$PY" -c 'import json, sys
steps = json.load(open(sys.argv[1]))["steps"]
sys.exit(0 if all(s["status"] == "ok" or s["status"].startswith("skipped") for s in steps.values()) else 1)' "$OUTDIR/gpu_proof.json"
