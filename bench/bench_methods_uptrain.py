"""Does a better training-free start stay ahead after training? Equal uptraining budget per start.

    .venv/bin/python bench/bench_methods_uptrain.py --g 2 1 --tokens 200000

For each method: convert ../shared/models/stories260K, uptrain it with
configs/stories260K-g2.yaml (text sampled from the original model, KL to its logits,
never the evaluation text) for the same number of tokens, then measure perplexity on
../shared/data/tinystories/valid-excerpt.txt (context 512). Appends JSON lines to
bench/results/methods_uptrain.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_methods import MODELS, REPO, perplexity  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--g", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--methods", nargs="+", default=["mean", "align", "align-scale", "align-refit"])
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--out", default=str(REPO / "bench/results/methods_uptrain.jsonl"))
    args = ap.parse_args()
    from gqakit.convert.pipeline import convert_checkpoint
    from gqakit.uptrain import run_uptrain

    m = MODELS["stories"]
    for g in args.g:
        for method in args.methods:
            with tempfile.TemporaryDirectory() as tmp:
                conv = Path(tmp) / "conv"
                convert_checkpoint(m["src"], conv, g, method, progress=False, options={"progress": False})
                before = perplexity(conv, m["data"], None)
                t0 = time.perf_counter()
                final = run_uptrain(str(REPO / "configs/stories260K-g2.yaml"),
                                    [f"model.path={conv}", f"output.dir={Path(tmp) / 'run'}",
                                     f"teacher.path={m['src']}", f"data.eval_file={m['data']}",
                                     f"train.tokens={args.tokens}", "eval.every=0",
                                     "output.save_every=0"], quiet=True)
                secs = time.perf_counter() - t0
                after = perplexity(final, m["data"], None)
            row = {"model": "stories", "G": g, "method": method, "ppl_before": round(before, 3),
                   "ppl_after": round(after, 3), "train_tokens": args.tokens, "train_seconds": round(secs, 1)}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
