"""Per-layer KV heads under a budget (`--kv-budget`) against uniform G at equal KV bytes.

    .venv/bin/python -m bench.bench_kv_budget stories --budgets 0.5 0.25 --uniform 2 1 --original
    .venv/bin/python -m bench.bench_kv_budget smollm2 --src SMOLLM2_FOLDER --budgets 1/3 0.5 0.67 \\
        --uniform 1 --original --calibration-tokens 4096

The damage of every layer's candidates is measured once (`gqakit.convert.budget.choose.measure`:
the loss increase on the calibration text when only that layer is converted, by `--probe`, which
is `--method` unless given: a closed-form method, or align-refit's closed-form fits for
align-refit; `--probe align` measures an align-refit conversion's candidates with align), then
each budget's plan is the exact allocation (`plan_for`). Each plan's perplexity (the uniform
ones too) is measured on the source model with the plan applied in place, the pooled K/V heads
repeated back (`damage.apply_plan`): the same function as the converted model, so the same
perplexity. `--via convert` instead writes each plan with `gqakit convert --kv-budget B` (or
`-g G`) and evaluates the output; with `--replay`, a budget's plan as measured here goes to
`gqakit convert --kv-plan` (the same plan, without measuring the damages again per budget);
`--plan 1,2,1,2,4` also writes a hand-written plan that way.

Perplexity: `bench.common.perplexity` (context 512, stride 512, BOS prepended), float32.
stories260K: ../shared/data/tinystories/valid-excerpt.txt; calibration text sampled from the
source (no file). SmolLM2-135M: a float32 model folder of the SmolLM2 GGUF (`gqakit convert
GGUF FOLDER -g 3 --force`), the first 300,000 characters of WikiText-2 raw test; calibration
from ../shared/data/wikitext-2/valid.txt. Rows go to bench/results/kv_budget.jsonl; with
`--plot`, perplexity against KV bytes per token as a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, SHARED, append_jsonl, perplexity, say

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = {
    "stories": dict(src=SHARED / "models/stories260K", data=SHARED / "data/tinystories/valid-excerpt.txt",
                    max_chars=None, calib=None),
    "smollm2": dict(src=None, data=SHARED / "data/wikitext-2-raw/wiki.test.raw", max_chars=300_000,
                    calib=str(SHARED / "data/wikitext-2/valid.txt")),
    "custom": dict(src=None, data=None, max_chars=None, calib=None),
}


def plan_ppl(src: Path, kv_heads: tuple[int, ...], method: str, data: Path, max_chars: int | None,
             seed: int, context: int = 512) -> float:
    """Perplexity of SRC with the per-layer plan applied in place (pool, then repeat back)."""
    import torch

    from gqakit.convert.budget.damage import apply_plan
    from gqakit.core import arch as archmod
    from gqakit.core.loading import load_causal_lm, load_tokenizer, read_config_json

    cfg = read_config_json(src)
    spec = archmod.lookup(cfg)
    model = load_causal_lm(src, dtype=torch.float32, progress=False)
    apply_plan(model, spec, archmod.shape_of(spec, cfg), kv_heads, method=method, seed=seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        load_tokenizer(src).save_pretrained(tmp)
        del model
        return perplexity(tmp, data, max_chars, context=context)


def convert_ppl(src: Path, how: list[str], method: str, calib: str | None, tokens: int, data: Path,
                max_chars: int | None, context: int = 512, seed: int = 0) -> tuple[float, float, float]:
    """Perplexity of `gqakit convert SRC OUT HOW --method M` (HOW: -g G or --kv-budget B, and any
    further convert options), and the conversion's wall and CPU seconds (with --kv-budget, the
    damage measurement is part of them; CPU seconds compare on a machine shared with other work)."""
    import resource

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "gqakit", "convert", str(src), str(out), *how, "--method", method,
               "--calibration-tokens", str(tokens), "--seed", str(seed), "-q",
               *(["--calibration-data", calib] if calib else [])]
        t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True)
        seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        return perplexity(out, data, max_chars, context=context), seconds, cpu


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, style in (("uniform", "o-"), ("budget", "s"), ("plan", "D"), ("original", "^")):
        pts = sorted((r["kv_bytes_per_token"], r["ppl"]) for r in rows if r["kind"] == kind)
        if pts:
            ax.plot(*zip(*pts), style, label={"uniform": "uniform G", "budget": "--kv-budget (per-layer G)",
                                              "plan": "--kv-plan (hand-written)", "original": "original"}[kind])
    ax.set_xlabel("KV cache bytes per token")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=list(MODELS))
    ap.add_argument("--src", default=None, help="the source model folder (required for smollm2 and custom)")
    ap.add_argument("--data", default=None, help="the evaluation text [default: the model's]")
    ap.add_argument("--calibration-data", default="default", help="a text file; '' samples from the source")
    ap.add_argument("--calibration-tokens", type=int, default=16384)
    ap.add_argument("--budgets", nargs="+", default=["0.5", "0.25"])
    ap.add_argument("--uniform", type=int, nargs="*", default=[2, 1])
    ap.add_argument("--original", action="store_true", help="also the source model")
    ap.add_argument("--method", default="align", help="a closed-form method: the damage probe and the conversion")
    ap.add_argument("--probe", default=None,
                    help="the method the damages are measured with: a closed-form method, or align-refit (its "
                         "closed-form fits) [default: --method]")
    ap.add_argument("--max-chars", type=int, default=None)
    ap.add_argument("--context", type=int, default=512, help="the perplexity window (stride: the same)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--via", choices=("equivalence", "convert"), default="equivalence")
    ap.add_argument("--replay", action="store_true",
                    help="with --via convert: write each budget's plan with --kv-plan (the plan this run measured) "
                         "instead of --kv-budget, which measures the damages again in every conversion")
    ap.add_argument("--uniform-option", action="append", default=[], metavar="K=V",
                    help="with --via convert: a --refit-option for the uniform conversions only (e.g. steps=3000, "
                         "to give them the time the per-layer conversion spends measuring damages)")
    ap.add_argument("--budget-option", action="append", default=[], metavar="K=V",
                    help="with --via convert: a --refit-option for the per-layer conversions only (e.g. steps=625, "
                         "the uniform conversions' steps spread over the layers the plan converts)")
    ap.add_argument("--plan", action="append", default=[], metavar="G,G,...",
                    help="also a hand-written per-layer plan, written by gqakit convert --kv-plan (with "
                         "--budget-option's options), e.g. 1,2,1,2,4")
    ap.add_argument("--out", default=str(RESULTS / "kv_budget.jsonl"))
    ap.add_argument("--plot", default=None, help="write the curve as this PNG")
    args = ap.parse_args(argv)
    from gqakit.convert.budget.choose import measure, plan_for
    from gqakit.convert.budget.kvbudget import KvBudget
    from gqakit.convert.settings import ConvertSettings
    from gqakit.convert.source import open_model

    m = dict(MODELS[args.model])
    src = Path(args.src) if args.src else m["src"]
    if src is None:
        ap.error(f"{args.model} needs --src")
    data = Path(args.data) if args.data else m["data"]
    max_chars = args.max_chars or m["max_chars"]
    calib = m["calib"] if args.calibration_data == "default" else (args.calibration_data or None)
    probe = args.probe or args.method
    settings = ConvertSettings(source=src, kv_budget=args.budgets[0], method=probe, calibration_data=calib,
                               calibration_tokens=args.calibration_tokens, seed=args.seed)
    t0, c0 = time.perf_counter(), time.process_time()
    measured = measure(open_model(src, progress=False), settings, progress=False)
    measure_s, measure_cpu = time.perf_counter() - t0, time.process_time() - c0
    say(f"measured every layer's damage in {measure_s:.1f} s ({measured.measured['calibration']})")
    per_head = measured.layers[0][0].cost // measured.layers[0][0].heads
    kv = measured.layers[0][0].heads
    nl = len(measured.layers)
    plans: list[tuple[str, str, tuple[int, ...], dict[str, Any]]] = []
    if args.original:
        plans.append(("original", "-", (kv,) * nl, {}))
    for g in args.uniform:
        plans.append(("uniform", f"G={g}", (g,) * nl, {}))
    for b in args.budgets:
        choice = plan_for(measured, KvBudget.parse(b))
        plans.append(("budget", b, choice.kv_heads, {"total_damage": choice.measured["total_damage"]}))
    for hand in args.plan:
        heads = tuple(int(g) for g in hand.split(","))
        if len(heads) != nl:
            ap.error(f"--plan {hand}: {len(heads)} layers, the model has {nl}")
        plans.append(("plan", hand, heads, {}))
    common = {"model": args.model, "source": src.name, "method": args.method, "probe": measured.measured["probe"],
              "via": args.via + (" (--kv-plan replay)" if args.replay else ""),
              "calibration": measured.measured["calibration"], "calibration_tokens": args.calibration_tokens,
              "measure_seconds": round(measure_s, 1), "measure_cpu_seconds": round(measure_cpu, 1),
              "eval_chars": max_chars, "context": args.context, "seed": args.seed, "device": "cpu",
              "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    rows = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for kind, label, heads, extra in plans:
        if kind == "original" or args.via == "equivalence":
            ppl = plan_ppl(src, heads, args.method, data, max_chars, args.seed, args.context) \
                if kind != "original" else perplexity(src, data, max_chars, context=args.context)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                if kind == "uniform":
                    how = ["-g", label.removeprefix("G=")]
                    for opt in args.uniform_option:
                        how += ["--refit-option", opt]
                elif args.replay or kind == "plan":
                    (Path(tmp) / "plan.json").write_text(json.dumps({"kv_heads": list(heads)}))
                    how = ["--kv-plan", str(Path(tmp) / "plan.json")]
                else:
                    how = ["--kv-budget", label]
                for opt in (args.budget_option if kind in ("budget", "plan") else []):
                    how += ["--refit-option", opt]
                ppl, seconds, cpu = convert_ppl(src, how, args.method, calib, args.calibration_tokens, data,
                                                max_chars, args.context, args.seed)
                extra = {**extra, "convert_seconds": round(seconds, 1), "convert_cpu_seconds": round(cpu, 1),
                         **({"refit_options": args.uniform_option} if kind == "uniform" and args.uniform_option
                            else {}),
                         **({"refit_options": args.budget_option} if kind in ("budget", "plan") and args.budget_option
                            else {})}
        nbytes = sum(heads) * per_head
        row = {**common, "kind": kind, "plan": label, "kv_heads": list(heads), "kv_bytes_per_token": nbytes,
               "fraction": round(nbytes / (kv * nl * per_head), 4), "ppl": round(ppl, 3), **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)
        append_jsonl(args.out, row)
    print(table(rows))
    if args.plot:
        plot(rows, Path(args.plot), f"{src.name}: perplexity vs KV bytes ({args.method})")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| plan | KV heads per layer | KV bytes/token (fraction) | perplexity |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["kv_bytes_per_token"]):
        name = {"budget": f"--kv-budget {r['plan']}", "uniform": f"uniform {r['plan']}",
                "plan": f"--kv-plan {r['plan']}"}.get(r["kind"], "original")
        heads = ",".join(map(str, r["kv_heads"]))
        lines.append(f"| {name} | {heads} | {r['kv_bytes_per_token']:,} ({r['fraction']:.3g}) | {r['ppl']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
