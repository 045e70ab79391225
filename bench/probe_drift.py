"""Held-out residual drift of SmolLM2-135M G=1 after the first N layers of `align-refit`,
for several option sets (a quick signal: no perplexity, only the first layers).

    OMP_NUM_THREADS=1 .venv/bin/python bench/probe_drift.py 4 8192 '{"steps": 0}' '{"steps": 60, "lr": 0.03}'

Arguments: layers, calibration tokens (../shared/data/wikitext-2/valid.txt), then one JSON
option set per run; holdout 0.25 is added, so the drift is measured on calibration
sequences the fits never saw. One thread. Rows go to bench/results/reconstruction_probe.jsonl.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_methods as bm  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "reconstruction_probe.jsonl"


def main() -> None:
    import torch

    from gqakit.convert.calibration import CalibrationStage
    from gqakit.convert.plan import make_plan
    from gqakit.convert.settings import ConvertSettings
    from gqakit.convert.source import open_checkpoint

    torch.set_num_threads(1)
    n_layers, tokens = int(sys.argv[1]), int(sys.argv[2])
    for spec in sys.argv[3:]:
        opts = {"holdout": 0.25, **json.loads(spec)}
        s = ConvertSettings(source=bm.SMOL, num_kv_heads=1, method="align-refit",
                            calibration_data=bm.MODELS["smollm2"]["calib"], calibration_tokens=tokens, refit=opts)
        opened = open_checkpoint(bm.SMOL, progress=False)
        stage = CalibrationStage(opened, make_plan(opened, s), s, progress=False)
        t, times = time.time(), []
        for _ in itertools.islice(stage.layers(), n_layers):
            times.append(round(time.time() - t, 1))
        row = {"model": "smollm2", "G": 1, "opts": opts, "tokens": tokens, "layers": n_layers,
               "heldout_drift": [round(d, 4) for d in stage.drift], "elapsed_at_layer": times, "recon": stage.fit.record().get("reconstruction", []),
               "device": "cpu", "threads": 1}
        print(json.dumps(row), flush=True)
        with open(OUT, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
