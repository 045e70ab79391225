"""Uptraining recovery of stories260K converted to G=2 by mean pooling (docs/benchmarks.md).

Converts ../shared/models/stories260K to G=2 (mean), uptrains it with
configs/stories260K-g2.yaml (text sampled from the original model) at several token
budgets (the recipe, and for comparison all-weights KL-only or LM-only runs), and reports held-out
perplexity on ../shared/data/tinystories/valid-excerpt.txt (context 512, stride 512,
one BOS prepended; gqakit.eval.perplexity) next to the original's and the converted one's.

    .venv/bin/python -m bench.uptrain_recovery --workdir /tmp/gqakit-recovery \
        --budgets 500000 2000000 --modes recipe kd
    .venv/bin/python -m bench.uptrain_recovery --workdir /tmp/gqakit-recovery --table-only

Each run is a separate `gqakit uptrain` with its own warm-up and cosine schedule, so a
budget's number is what a user gets by asking for that budget. Finished runs are reused.
Results: WORKDIR/recovery.json and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import REPO, SHARED
from bench.common import perplexity as _perplexity_of

ORIGINAL = SHARED / "models" / "stories260K"
EVAL = SHARED / "data" / "tinystories" / "valid-excerpt.txt"
RECIPE = REPO / "configs" / "stories260K-g2.yaml"


def perplexity(folder: Path) -> float:
    return _perplexity_of(folder, EVAL, context=512, stride=512)


# recipe: the config as is (attention only, KL to the original's logits + residual-stream MSE);
# kd: the earlier recipe, all weights, KL only; lm: all weights, next-token loss only.
_ALL = ["train.trainable=null", "teacher.hidden_weight=0.0", "train.lr=2e-3", "train.micro_batch=8"]
MODES = {"recipe": [],
         "kd": ["teacher.kl_weight=1.0", "teacher.lm_weight=0.0", *_ALL],
         "lm": ["teacher.kl_weight=0.0", "teacher.lm_weight=1.0", *_ALL]}
LABELS = {"recipe": "attention only, KL + hidden-state MSE (the recipe)", "kd": "all weights, KL only",
          "lm": "all weights, next-token loss only"}


def run_dir(work: Path, tokens: int, mode: str) -> Path:
    return work / f"run-{mode}-{tokens}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-recovery"))
    ap.add_argument("--budgets", type=int, nargs="+", default=[500_000, 1_000_000, 2_000_000])
    ap.add_argument("--modes", nargs="+", default=["recipe"], choices=list(MODES))
    ap.add_argument("--table-only", action="store_true", help="only evaluate the runs already finished")
    ap.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    args = ap.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    g2 = work / "s260k-g2"
    if not (g2 / "config.json").is_file():
        from gqakit.convert import convert_checkpoint

        convert_checkpoint(ORIGINAL, g2, 2, method="mean")

    runs = []
    for mode in args.modes:
        for tokens in args.budgets:
            out = run_dir(work, tokens, mode)
            if not (out / "model" / "config.json").is_file() and not args.table_only:
                cmd = [sys.executable, "-m", "gqakit", "uptrain", str(RECIPE), f"model.path={g2}", f"output.dir={out}",
                       f"teacher.path={ORIGINAL}", f"data.eval_file={EVAL}",
                       f"train.tokens={tokens}", *MODES[mode], *args.overrides, "--overwrite"]
                print("+", " ".join(cmd), flush=True)
                t0 = time.time()
                subprocess.run(cmd, check=True, cwd=REPO)
                (out / "wall_s.txt").write_text(f"{time.time() - t0:.0f}\n")
            if (out / "model" / "config.json").is_file():
                runs.append((mode, tokens, out))
    if args.table_only:  # every finished run in WORKDIR, including ones made with extra overrides
        known = {o for _, _, o in runs}
        runs += [("other", 0, o) for o in sorted(work.glob("run-*")) if (o / "model" / "config.json").is_file() and o not in known]

    rows = [{"model": "original (4 KV heads)", "ppl": perplexity(ORIGINAL)},
            {"model": "mean-pooled G=2, no training", "ppl": perplexity(g2)}]
    base = rows[0]["ppl"]
    for mode, tokens, out in runs:
        log = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]
        train = [r for r in log if "loss" in r]
        wall = (out / "wall_s.txt").read_text().strip() if (out / "wall_s.txt").is_file() else None
        label = LABELS.get(mode, out.name)
        rows.append({"model": f"G=2 uptrained, {label}", "tokens": train[-1]["tokens"], "steps": train[-1]["step"],
                     "mode": mode, "ppl": perplexity(out / "model"), "final_train_loss": train[-1]["loss"],
                     "wall_s": int(wall) if wall else None})
    for r in rows:
        r["vs_original"] = r["ppl"] / base - 1
    info = {"device": platform.processor() or platform.machine(), "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or torch.get_num_threads(),
            "torch": torch.__version__, "dtype": "float32", "eval": f"{EVAL.name}, context 512, stride 512, BOS prepended",
            "recipe": str(RECIPE.relative_to(REPO)), "overrides": args.overrides}
    (work / "recovery.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print("\n| model | tokens | steps | held-out ppl | vs original | wall (s) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r.get('tokens', '')!s:>9} | {r.get('steps', '')} | {r['ppl']:.3f} | "
              f"{r['vs_original']:+.1%} | {r.get('wall_s') or ''} |")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
