"""Block-wise reconstruction settings on stories260K (issue 10): one calibration sample,
several `align-refit` option sets, perplexity of each.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_reconstruction.py 2 similarity 16384 \\
        '{"steps": 100, "lr": 3e-2}' '{"steps": 300, "lr": 3e-2}'

Arguments: G, grouping, calibration tokens, then one JSON option set per conversion.
The calibration text is sampled from the source model once (seed 0) and reused for every
option set, so the rows differ only by their options. Evaluation as bench_methods.py
(../shared/data/tinystories/valid-excerpt.txt, context 512, stride 512, BOS, fp32), one
thread. Rows are appended to bench/results/reconstruction.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_methods as bm  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "reconstruction.jsonl"


def main() -> None:
    import torch

    from gqakit.convert.calibration import stage as calibrate
    from gqakit.convert.pipeline import convert_checkpoint

    torch.set_num_threads(1)
    real, cache = calibrate.calibration_sequences, {}

    def cached(*a, **k):  # the same sampled calibration text for every option set
        key = (a[2], a[3], a[4])
        if key not in cache:
            cache[key] = real(*a, **k)
        return cache[key]

    calibrate.calibration_sequences = cached
    m = bm.MODELS["stories"]
    g, grouping, tokens = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for spec in sys.argv[4:]:
        opts = json.loads(spec)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            convert_checkpoint(m["src"], Path(tmp) / "o", g, "align-refit", grouping=grouping,
                               calibration_tokens=tokens, options=opts, progress=False)
            secs = time.perf_counter() - t0
            rec = json.loads((Path(tmp) / "o" / "gqakit_convert.json").read_text())["calibration"]
            ppl = bm.perplexity(Path(tmp) / "o", m["data"], None, threads=1)
        row = {"model": "stories", "G": g, "grouping": grouping, "tokens": tokens, "opts": opts, "ppl": round(ppl, 3),
               "secs": round(secs, 1), "drift": rec["residual_drift"][-1] if rec["residual_drift"] else None,
               "recon": [(r["best_step"], round(r["guard_best"], 4)) for r in rec.get("reconstruction", [])],
               "device": "cpu", "threads": 1, "cores": os.cpu_count()}
        print(json.dumps(row), flush=True)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        with open(OUT, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
