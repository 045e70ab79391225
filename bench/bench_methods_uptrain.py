"""Does a better training-free start stay ahead after training? Equal uptraining budget per start.

    .venv/bin/python -m bench.bench_methods_uptrain --g 2 1 --tokens 100000
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bench_methods_uptrain stories --g 2 --methods align-refit \
        --grouping similarity --options '{"steps": 300, "lr": 0.03}' --tokens 100000
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.bench_methods_uptrain smollm2 --g 1 \\
        --methods mean align-refit align --tokens 49152 --ppl-before documented --workdir /tmp/smol-eq

For each method: convert the model, uptrain it for the same number of tokens, then measure
perplexity with bench_methods.perplexity. Appends JSON lines to
bench/results/methods_uptrain.jsonl.

- stories (default): ../shared/models/stories260K, configs/stories260K-g2.yaml (text
  sampled from the original model, KL to its logits, never the evaluation text),
  ../shared/data/tinystories/valid-excerpt.txt (context 512).
- smollm2: the SmolLM2-135M-Instruct GGUF, configs/smollm2-135M-g1.yaml on CPU (WikiText-2
  valid + tinyshakespeare; the WikiText-2 test file is only evaluated, never trained on; the
  trainer's own held-out evaluation is switched off), the first 300,000 characters of
  WikiText-2 raw test (context 512). align-refit calibrates on WikiText-2 valid.
  Converted folders are kept in --workdir and reused when their settings match.
  --ppl-before documented takes the before-training numbers from bench/results/methods.jsonl
  (same conversion, same evaluation) instead of measuring them again.

Threads: --threads (default $OMP_NUM_THREADS, else all cores) for training and evaluation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_methods import MODELS
from bench.common import REPO, RESULTS, SHARED, append_jsonl, perplexity

# Before-training perplexity already measured by bench_methods.py (bench/results/methods.jsonl,
# full evaluation protocol, G=1, contiguous; align-refit with 8,192 WikiText-2 valid tokens).
DOCUMENTED_BEFORE = {("smollm2", 1, "mean"): 24006.156, ("smollm2", 1, "align"): 14765.77,
                     ("smollm2", 1, "align-refit"): 860.811}

RECIPES = {
    "stories": dict(config="configs/stories260K-g2.yaml", calibration_tokens=16384,
                    overrides=lambda m: [f"teacher.path={m['src']}", f"data.eval_file={m['data']}"]),
    # CPU version of the GPU recipe: same data, lr and schedule shape; 1,024-token steps
    # (2 x 512, no accumulation) so that a small budget still makes enough optimizer steps,
    # and a warm-up scaled to the budget (the recipe's 30 steps would exceed it).
    "smollm2": dict(config="configs/smollm2-135M-g1.yaml", calibration_tokens=8192,
                    overrides=lambda m: ["train.cpu=true", "train.seq_len=512", "train.micro_batch=2",
                                         "train.grad_accum=1", "train.warmup_steps=4",
                                         f"data.files=[{SHARED}/data/wikitext-2/valid.txt, "
                                         f"{SHARED}/data/tinyshakespeare/input.txt]"]),
}


def _convert(m: dict, out: Path, g: int, method: str, calib_tokens: int | None,
             options: dict | None = None, grouping: str = "contiguous") -> float | None:
    """Convert into `out`, or reuse `out` if it holds the same conversion. Seconds, or None if reused."""
    from gqakit.convert.pipeline import convert_checkpoint

    calib = m["calib"] if method == "align-refit" else None
    want = {"source": str(Path(m["src"]).expanduser().resolve()), "num_kv_heads": g, "method": method, "grouping": grouping,
            "options": options or {}}
    meta = out / "gqakit_convert.json"
    if meta.exists() and (out / "config.json").exists():
        have = json.loads(meta.read_text()).get("settings", {})
        if all(str(have.get(k)) == str(v) for k, v in want.items()) and (
                method != "align-refit" or (str(have.get("calibration_data")) == str(calib)
                                            and have.get("calibration_tokens") == calib_tokens)):
            print(f"reusing {out}", flush=True)
            return None
    if out.exists():
        shutil.rmtree(out)
    kw = {} if calib_tokens is None else {"calibration_data": calib, "calibration_tokens": calib_tokens}
    t0 = time.perf_counter()
    convert_checkpoint(m["src"], out, g, method, grouping=grouping, progress=False, options=options, **kw)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="stories", choices=list(RECIPES))
    ap.add_argument("--g", type=int, nargs="+", default=None, help="default: 2 1 (stories), 1 (smollm2)")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="default: mean align align-scale align-refit (stories), mean align align-refit (smollm2)")
    ap.add_argument("--tokens", type=int, default=None, help="default: 200000 (stories), 49152 (smollm2)")
    ap.add_argument("--workdir", default=None, help="keep converted folders and runs here (default: a temp dir)")
    ap.add_argument("--ppl-before", choices=["measure", "documented"], default="measure")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    ap.add_argument("--set", dest="extra", nargs="*", default=[], help="extra uptrain overrides key=value")
    ap.add_argument("--options", default="{}", help="JSON align-refit options (e.g. reconstruction steps)")
    ap.add_argument("--grouping", default="contiguous")
    ap.add_argument("--calibration-tokens", type=int, default=None,
                    help="align-refit calibration tokens (default: 16384 stories, 8192 smollm2)")
    ap.add_argument("--out", default=str(RESULTS / "methods_uptrain.jsonl"))
    args = ap.parse_args()
    import torch

    from gqakit.uptrain import run_uptrain

    torch.set_num_threads(args.threads)
    os.chdir(REPO)  # the recipes' data paths are relative to the repo root
    smol = args.model == "smollm2"
    gs = args.g or ([1] if smol else [2, 1])
    methods = args.methods or (["mean", "align", "align-refit"] if smol else ["mean", "align", "align-scale", "align-refit"])
    tokens = args.tokens or (49_152 if smol else 200_000)
    m, recipe = MODELS[args.model], RECIPES[args.model]
    device = f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}, fp32"
    for g in gs:
        for method in methods:
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(args.workdir or tmp)
                work.mkdir(parents=True, exist_ok=True)
                opts = json.loads(args.options) if method == "align-refit" else {}
                label = method + (f" + {opts['steps']} steps (lr {opts.get('lr')})" if opts.get("steps") else "")
                label += "" if args.grouping == "contiguous" else f", {args.grouping}"
                tag = hashlib.sha1((json.dumps(opts, sort_keys=True) + args.grouping).encode()).hexdigest()[:8]
                conv = work / f"conv-g{g}-{method}-{tag}"
                conv_secs = _convert(m, conv, g, method, args.calibration_tokens or recipe["calibration_tokens"],
                                     opts or None, args.grouping)
                key = (args.model, g, method)
                if args.ppl_before == "documented" and key in DOCUMENTED_BEFORE and not opts:
                    before, before_src = DOCUMENTED_BEFORE[key], "documented (bench/results/methods.jsonl)"
                else:
                    t0 = time.perf_counter()
                    before = perplexity(conv, m["data"], m["max_chars"], threads=args.threads)
                    before_src = f"measured ({time.perf_counter() - t0:.0f} s)"
                run_dir = work / f"run-g{g}-{method}-{tokens}"
                if run_dir.exists():
                    shutil.rmtree(run_dir)
                overrides = [f"model.path={conv}", f"output.dir={run_dir}", *recipe["overrides"](m),
                             f"train.tokens={tokens}", "eval.every=0", "output.save_every=0", *args.extra]
                t0 = time.perf_counter()
                final = run_uptrain(str(REPO / recipe["config"]), overrides, quiet=True)
                secs = time.perf_counter() - t0
                log = [json.loads(s) for s in (run_dir / "log.jsonl").read_text().splitlines() if s.strip()]
                train_rows = [r for r in log if "loss" in r]
                t0 = time.perf_counter()
                after = perplexity(final, m["data"], m["max_chars"], threads=args.threads)
                eval_secs = time.perf_counter() - t0
                if args.workdir:  # keep the converted folder for reuse, not the 0.5 GB trained copy
                    shutil.rmtree(final, ignore_errors=True)
            row = {"model": args.model, "G": g, "method": label, "ppl_before": round(before, 3),
                   "ppl_after": round(after, 3), "train_tokens": tokens, "train_seconds": round(secs, 1)}
            row.update({"ppl_before_source": before_src, "eval_seconds": round(eval_secs, 1),
                        "convert_seconds": None if conv_secs is None else round(conv_secs, 1),  # None: reused
                        "calibration_tokens": (args.calibration_tokens or recipe["calibration_tokens"])
                        if method == "align-refit" else None,
                        "eval_chars": m["max_chars"], "steps": train_rows[-1]["step"] if train_rows else None,
                        "final_train_loss": round(train_rows[-1]["loss"], 4) if train_rows else None,
                        "config": recipe["config"], "overrides": overrides[2:], "threads": args.threads,
                        "device": device})
            print(json.dumps(row), flush=True)
            append_jsonl(args.out, row)


if __name__ == "__main__":
    sys.exit(main())
