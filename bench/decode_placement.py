"""Does one model's decode step depend on what else the process measured first? (issue 13)

On the project's VM a converted model's CPU decode step sometimes ran ~1.4x slower for a
whole run (docs/benchmarks.md, session 10). That turned out to be the per-op path, after the
fused step's check refused the model by mistake (fixed in session 11; each row records the
path in `layers`), not memory placement as first thought. This loads models in the order given, measures
each at one grid point in turn (not alternating: the point is what one model's presence does
to the next), for --rounds rounds, and records per model and round the median step time and
the process's memory on transparent huge pages (AnonHugePages) after the point.

    G=~/.cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python bench/decode_placement.py $G /tmp/i13/smol-g1            # GGUF original measured first
    .venv/bin/python bench/decode_placement.py $G:per-op /tmp/i13/smol-g1     # ... on the per-op path
    .venv/bin/python bench/decode_placement.py /tmp/i13/smol-g3 /tmp/i13/smol-g1
    .venv/bin/python bench/decode_placement.py --load-first $G /tmp/i13/smol-g3 /tmp/i13/smol-g1
    .venv/bin/python bench/decode_placement.py /tmp/i13/smol-g1                # alone

MODEL[:per-op] measures that model without fused decode layers. --load-first loads a model
and does not measure it. Appends one JSON line per run to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="MODEL or MODEL:per-op, measured in this order")
    ap.add_argument("--load-first", default=None, help="a model loaded before the others and never measured")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/decode_placement.jsonl")
    args = ap.parse_args()
    out = Path(args.out)
    specs = [(m[: -len(":per-op")], False) if m.endswith(":per-op") else (m, True) for m in args.models]
    for m in [m for m, _ in specs] + ([args.load_first] if args.load_first else []):
        if not Path(m).exists():
            sys.exit(f"decode_placement: no such model: {m}")
        if out.resolve() == Path(m).resolve():
            sys.exit(f"decode_placement: --out names a model: {m}")

    import torch

    from gqakit.core.loading import load_causal_lm
    from gqakit.eval.provenance import run_info
    from gqakit.eval.speed import DecodeBench, huge_page_bytes

    torch.set_num_threads(args.threads)
    first = load_causal_lm(args.load_first, dtype=torch.float32, device="cpu") if args.load_first else None
    benches = [(m, fuse, DecodeBench(load_causal_lm(m, dtype=torch.float32, device="cpu"), device="cpu",
                                     dtype=torch.float32, fuse_layers=fuse)) for m, fuse in specs]
    roof = {"copy_bandwidth": 4e10, "matmul_flops": 2e11, "ridge_flops_per_byte": 5.0}  # not used for timing
    rows = []
    for r in range(args.rounds):
        for m, fuse, b in benches:
            pt = b.run_point(args.batch, args.prompt_len, args.new_tokens, args.reps, 1, roof, prefill_once=True)
            huge = huge_page_bytes()
            rows.append({"round": r, "model": m, "fused_layers": fuse, "layers": pt.decode_path.get("layers"),
                         "ms_per_step": pt.decode_ms_per_token["median"], "anon_huge_pages_bytes": huge})
            print(f"round {r}  {Path(m).name[:32]:<32} {'fused' if fuse else 'per-op':<6} "
                  f"{pt.decode_ms_per_token['median']:6.2f} ms/step   AnonHugePages {(huge or 0) / 2**20:,.0f} MiB",
                  flush=True)
    del first
    rec = {"argv": sys.argv, "batch": args.batch, "prompt_len": args.prompt_len, "threads": args.threads,
           "load_first": args.load_first, "rows": rows, "loadavg": os.getloadavg(), "time": time.strftime("%F %T"),
           "run": run_info(command=sys.argv, device="cpu", dtype=torch.float32).to_json()}
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


if __name__ == "__main__":
    main()
