"""Layer-streamed align-refit at scale: peak memory and time against depth and token budget.

Builds random bf16 checkpoints with Llama-2-7B's layer shape (hidden 4096, 32 heads,
MLP 11008, vocab 32000; random normal values, never zeros) at each requested depth, and
converts each to G KV heads with `gqakit convert --method align-refit` in a subprocess,
sampling its RssAnon every 10 ms (bench_convert_io.py's sampler). The GPU peak comes from
the conversion's own record (torch.cuda.max_memory_allocated). Calibration text is
WikiText-2 valid from ../shared, tokenised with stories260K's tokenizer (ids < 512 of
the 32,000-row embedding; the weights are random, so only the shapes matter).

    .venv/bin/python -m bench.bench_calibrate_scale --layers 2,4 --tokens 8192       # CPU
    python -m bench.bench_calibrate_scale --layers 32 --tokens 131072 --device cuda   # GPU

Appends one JSON line per run to bench/results/calibrate_scale.jsonl and prints a
Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

from bench.common import RESULTS, SHARED, append_jsonl, folder_bytes, timed_convert, write_random_llama_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-calib-bench"))
    ap.add_argument("--layers", default="2,4", help="comma-separated depths")
    ap.add_argument("--tokens", default="8192", help="comma-separated calibration budgets")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("-g", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data", type=Path, default=SHARED / "data" / "wikitext-2" / "valid.txt")
    ap.add_argument("--tokenizer-from", type=Path, default=SHARED / "models" / "stories260K")
    ap.add_argument("--refit-option", action="append", default=[], help="passed to convert, KEY=VALUE")
    ap.add_argument("--results", type=Path, default=RESULTS / "calibrate_scale.jsonl")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    args = ap.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"calibration text not found: {args.data} (set GQAKIT_SHARED or --data)")
    import torch

    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        src = args.workdir / f"src-{layers}L"
        if not (src / "config.json").is_file():
            print(f"building a {layers}-layer checkpoint ...", flush=True)
            shutil.rmtree(src, ignore_errors=True)
            write_random_llama_checkpoint(src, {"hidden": args.hidden, "layers": layers, "heads": args.heads,
                                                "intermediate": args.intermediate, "vocab": args.vocab})
            for name in TOKENIZER_FILES:
                if (args.tokenizer_from / name).is_file():
                    shutil.copy2(args.tokenizer_from / name, src / name)
        for tokens in [int(x) for x in args.tokens.split(",")]:
            out = args.workdir / f"out-{layers}L-{tokens}"
            extra = ("--method", "align-refit", "--effort", "fast", "--device", args.device, "--calibration-data",
                     str(args.data),
                     "--calibration-tokens", str(tokens), *[f"--refit-option={o}" for o in args.refit_option])
            print(f"converting {layers} layers with {tokens:,} calibration tokens on {args.device} ...", flush=True)
            secs, anon, hwm = timed_convert(src, out, args.g, extra)
            cal = json.loads((out / "gqakit_convert.json").read_text())["calibration"]
            row = {"layers": layers, "hidden": args.hidden, "heads": args.heads, "intermediate": args.intermediate,
                   "G": args.g, "tokens": cal["tokens"], "device": args.device,
                   "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else
                   (platform.processor() or platform.machine()), "cores": os.cpu_count(),
                   "source_bytes": folder_bytes(src), "seconds": round(secs, 1), "calibration_seconds": cal["seconds"],
                   "peak_rss_anon_bytes": anon, "vmhwm_bytes": hwm,
                   "device_peak_bytes": cal["peak_memory_bytes"] if args.device.startswith("cuda") else None,
                   "streams_on": cal["streams_on"], "stream_bytes": cal["stream_bytes"],
                   "compute_dtype": cal["compute_dtype"], "final_drift": (cal["residual_drift"] or [None])[-1],
                   "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M")}
            rows.append(row)
            args.results.parent.mkdir(parents=True, exist_ok=True)
            append_jsonl(args.results, row)
            print(json.dumps(row), flush=True)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
    gb = 1e9
    print("\n| layers | on disk | calibration tokens | device | wall | peak RssAnon | device peak | streams |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        dev = f"{r['device_peak_bytes'] / gb:.2f} GB" if r["device_peak_bytes"] else "-"
        print(f"| {r['layers']} | {r['source_bytes'] / gb:.2f} GB | {r['tokens']:,} | {r['device']} | {r['seconds']:.0f} s "
              f"| {r['peak_rss_anon_bytes'] / gb:.2f} GB | {dev} | {r['streams_on']}, {r['stream_bytes'] / gb:.2f} GB |")


if __name__ == "__main__":
    main()
