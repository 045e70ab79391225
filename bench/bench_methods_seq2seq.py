"""Training-free conversion quality of an encoder-decoder: every method at every G, scored by
the held-out span-corruption perplexity of the decoder's targets, through the CLI.

    python -m bench.bench_methods_seq2seq [--model ~/.cache/gqakit/tiny-t5] [--g 4 2 1]

The model is the small T5 1.1 `python -m bench.train_tiny_t5` trains (8 heads); the text is
`../shared/data/tinystories/valid-excerpt.txt`, span-corrupted with seed 0, inputs of 128
tokens. Rows go to bench/results/methods_seq2seq.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, SHARED, append_jsonl, say

HELD_OUT = SHARED / "data" / "tinystories" / "valid-excerpt.txt"


def gqakit(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "gqakit", *args, "-q"], check=True)


def perplexity(model: Path, out: Path, context: int) -> float:
    gqakit("eval", str(model), "--data", str(HELD_OUT), "--context", str(context), "--span-seed", "0",
           "--out", str(out))
    return float(json.loads(out.read_text())["perplexity"]["token_perplexity"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/gqakit/tiny-t5")
    ap.add_argument("--g", type=int, nargs="+", default=[4, 2, 1])
    ap.add_argument("--methods", nargs="+", default=["mean", "first", "random", "align"])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "methods_seq2seq.jsonl")
    args = ap.parse_args()
    base = {"model": str(args.model), "data": HELD_OUT.name, "context": args.context, "span_seed": 0,
            "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        ppl = perplexity(args.model, t / "orig.json", args.context)
        say(f"original: {ppl:.3f}")
        append_jsonl(args.out, {**base, "method": "original", "G": None, "ppl": round(ppl, 3)})
        for g in args.g:
            for method in args.methods:
                out = t / f"{method}-{g}"
                t0 = time.perf_counter()
                gqakit("convert", str(args.model), str(out), "-g", str(g), "--method", method)
                secs = time.perf_counter() - t0
                ppl = perplexity(out, t / f"{method}-{g}.json", args.context)
                say(f"G={g} {method}: {ppl:.3f}")
                append_jsonl(args.out, {**base, "method": method, "G": g, "ppl": round(ppl, 3),
                                        "convert_seconds": round(secs, 1)})


if __name__ == "__main__":
    main()
