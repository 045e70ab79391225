"""Decode speed of real models side by side: measured speedup against the roofline prediction.

Loads two or more models (the first is the baseline; e.g. SmolLM2-135M and its 3 -> 1 KV
head conversion) and times their decode steps with gqakit's decode benchmark
(`gqakit.eval.speed.DecodeBench`) over a batch x prompt grid. At each grid point all
models are set up first (cache, packed weights, warm-up, excluded from the timing), then
their timed decode steps alternate one by one, A B B A A B ..., so load from other processes on the
machine hits all alike; the copy bandwidth and matmul FLOP/s (the roofs) are measured
again at each point, between the models' repetitions.

Each non-baseline model gets, per point: the measured speedup (ratio of median decode
step times), the speedup predicted by bytes (weights + filled KV cache per step, baseline
over model), the one predicted by the roofline (each model's step at max(bytes / copy
bandwidth, FLOPs / matmul FLOP/s): differs from the bytes one only where a step is
compute-bound), the one predicted with no overlap of memory and compute (bytes / copy bandwidth
+ FLOPs / matmul FLOP/s: the pessimistic end near the ridge point), and the share of the
predicted gain achieved, (measured - 1) /
(predicted - 1).

    .venv/bin/python -m bench.bench_decode_pair ~/.cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        /tmp/smol-g1 --names original,3to1 --batch 8 --prompt-len 1024 --out /tmp/decode_pair.json
    .venv/bin/python -m bench.bench_decode_pair A B --batch 1,4,8,16 --prompt-len 256,1024 --eager   # plain steps

Writes JSON to `--out` after every point (a run stopped early keeps what it measured) and
a Markdown table to `--md`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="model folders or .gguf files; the first is the baseline")
    ap.add_argument("--names", default=None, help="comma-separated names, one per model")
    ap.add_argument("--batch", default="8")
    ap.add_argument("--prompt-len", default="1024")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--eager", action="store_true", help="the plain transformers step: no packed weights, SDPA decode")
    ap.add_argument("--both-paths", action="store_true",
                    help="each model twice, fast path and --eager (separate copies), all steps alternating: "
                         "what the fast path buys, measured in one run")
    ap.add_argument("--layers-both", action="store_true",
                    help="each model twice, the fast path with fused decode layers and without them (the per-op "
                         "fast path, named '(per-op)'), all steps alternating: what the fused layers buy, in one run")
    ap.add_argument("--no-fused-layers", action="store_true",
                    help="the fast path without fused decode layers (one compiled call per layer)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    ap.add_argument("--prefill-every-rep", action="store_true",
                    help="prefill before every repetition (default: once per point, decode repetitions rewind the cache)")
    ap.add_argument("--out", default="bench_decode_pair.json")
    ap.add_argument("--md", default=None)
    return ap


def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Measured against predicted speedup of `other` over `base` at one point (both status ok)."""
    from gqakit.eval.speed.roofline import StepCost, predict_speedup, share

    mb, mo = base["decode_ms_per_token"]["median"], other["decode_ms_per_token"]["median"]
    pred = predict_speedup(StepCost.of(base), StepCost.of(other))
    measured = mb / mo
    paths = [(r["decode_mode"], r.get("decode_path", {}).get("layers")) for r in (base, other)]
    out = {"measured_speedup": measured, "predicted_speedup_bytes": pred.bytes, "predicted_speedup_roofline": pred.roofline,
           "compute_bound": pred.compute_bound, "share_of_predicted": share(measured, pred.bytes),
           "share_of_predicted_roofline": share(measured, pred.roofline),
           # a ratio of two different code paths is not what GQA buys: said under the table
           "paths_differ": None if paths[0] == paths[1] else {"base": paths[0], "other": paths[1]}}
    if pred.no_overlap is not None:
        # No overlap: each step reads its bytes at the copy bandwidth and *then* does its FLOPs at
        # the matmul roof. The roofline above assumes perfect overlap (the max of the two); near
        # the ridge point the truth lies between, and the sum is the pessimistic end.
        rb, ro = base["roofline_ms"], other["roofline_ms"]
        sb, so = rb["bytes"] + rb["flops"], ro["bytes"] + ro["flops"]
        out.update(predicted_speedup_no_overlap=pred.no_overlap, share_of_predicted_no_overlap=share(measured, pred.no_overlap),
                   step_over_no_overlap={"base": mb / sb, "other": mo / so})
    return out


def markdown(data: dict[str, Any]) -> str:
    a, names = data["args"], data["names"]
    base = ", ".join(sorted(set(data.get("baseline_of", {names[0]: names[0]}).values())))
    lines = [
        f"Device: {data['run']['device_name']}, {a['dtype']}, torch threads {data['threads']}, torch "
        f"{data['run']['torch']}, transformers {data['run']['transformers']}; load average "
        f"{data['loadavg_start'][0]:.1f} at the start, {data.get('loadavg_end', [float('nan')])[0]:.1f} at the end "
        f"on {os.cpu_count()} cores (load above the thread count means other processes shared them); decode: {a['new_tokens']} new tokens after a random prompt, "
        f"{a['warmup']} warm-up run(s) excluded, median of {a['reps']} x {a['new_tokens']} single steps, the models' "
        "steps alternating one by one; steps: "
        + ", ".join(sorted({r['decode_mode'] for r in data['rows'] if r['status'] == 'ok'})) + "; "
        + "; ".join(f"{n}: {p['decode_path']}" for n, p in data["probes"].items()) + ".",
        "",
        "| batch | prompt | model | ms/step median (p90) | GB/s (% of copy) | memory-bound | speedup measured | "
        "predicted (bytes) | share of predicted | predicted (bytes + FLOPs, no overlap) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['model']} | {r['status']} | | | | | | |")
            continue
        c = r.get("comparison")
        cells = [str(r["batch"]), str(r["prompt_len"]), r["model"],
                 f"{r['decode_ms_per_token']['median']:.1f} ({r['decode_ms_per_token']['p90']:.1f})",
                 f"{r['achieved_bandwidth_gbs']:.1f} ({100 * r['roofline_fraction']:.0f}%)",
                 "yes" if r["memory_bound"] else "no"]
        if c is None:
            cells += ["baseline", "", "", ""]
        else:
            sh = c["share_of_predicted"]
            cells += [f"{c['measured_speedup']:.2f}×", f"{c['predicted_speedup_bytes']:.2f}×"
                      + (f" (roofline {c['predicted_speedup_roofline']:.2f}×)" if c["compute_bound"] else ""),
                      "n/a" if sh is None else f"{100 * sh:.0f}%",
                      f"{c['predicted_speedup_no_overlap']:.2f}×" if "predicted_speedup_no_overlap" in c else ""]
        lines.append("| " + " | ".join(cells) + " |")
    differ = sorted({(r["model"], data["baseline_of"][r["model"]], " / ".join(filter(None, r["comparison"]["paths_differ"]["other"])),
                      " / ".join(filter(None, r["comparison"]["paths_differ"]["base"])))
                     for r in data["rows"] if r.get("comparison", {}).get("paths_differ")})
    for n, b0, po, pb in differ:
        lines += ["", f"**Note**: {n} and {b0} ran different decode paths ({n}: {po}; {b0}: {pb}), so their "
                  "speedup compares two code paths, not only the bytes GQA saves."]
    lines.append("")
    lines.append(f"Models: " + "; ".join(f"{n}: `{p}`, {data['info'][n]['kv_heads']}/{data['info'][n]['heads']} KV/query heads, "
                                         f"{data['info'][n]['weight_bytes'] / 1e6:.0f} MB weights per step, "
                                         f"{data['info'][n]['kv_bytes_per_token'] / 1024:g} KiB KV per token"
                                         for n, p in zip(names, a["models"])) + f". Baseline(s): {base}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parser().parse_args()

    import torch

    from gqakit.core.loading import load_causal_lm
    from gqakit.eval.provenance import run_info
    from gqakit.eval.speed import DecodeBench, parse_ints, run_points_alternating

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    names = args.names.split(",") if args.names else [Path(m).stem for m in args.models]
    if len(names) != len(args.models) or len(set(names)) != len(names):
        sys.exit("bench_decode_pair: --names needs one distinct name per model")
    for out in (args.out, args.md):  # results never overwrite a model: checked before anything runs
        if out and any(Path(out).resolve() == Path(m).resolve() or Path(m).resolve() in Path(out).resolve().parents
                       for m in args.models):
            sys.exit(f"bench_decode_pair: {out} is one of the models or inside one; write the results elsewhere")
    batches, lens = parse_ints(args.batch, "--batch"), parse_ints(args.prompt_len, "--prompt-len")
    cuda = torch.device(args.device).type == "cuda"
    if args.both_paths and args.layers_both:
        sys.exit("bench_decode_pair: --both-paths and --layers-both are two different pairings; choose one")
    # variants: (suffix, fast path, fused layers)
    variants = ([("", True, True), (" (eager)", False, False)] if args.both_paths
                else [("", True, True), (" (per-op)", True, False)] if args.layers_both
                else [("", not args.eager, not args.no_fused_layers)])
    entries = [(n + suf, path, fast, fuse) for suf, fast, fuse in variants for n, path in zip(names, args.models)]
    base_of = {n + suf: names[0] + suf for suf, _, _ in variants for n in names}
    names = [e[0] for e in entries]
    args.models = [e[1] for e in entries]
    benches = {}
    for n, path, fast, fuse in entries:
        m = load_causal_lm(path, dtype=dtype, device=args.device)
        benches[n] = DecodeBench(m, device=args.device, dtype=dtype, compile=args.compile,
                                 cuda_graphs=fast and cuda and not args.compile, pack_weights=fast,
                                 decode_kernel="matmul" if fast else "sdpa", fuse_layers=fuse)
    data: dict[str, Any] = {
        "args": vars(args), "names": names, "baseline_of": base_of, "threads": torch.get_num_threads(),
        "probes": {n: b.probe() for n, b in benches.items()},
        "info": {n: {"heads": b.heads, "kv_heads": b.kv_heads, "weight_bytes": b.weight_bytes,
                     "kv_bytes_per_token": b.kv_bytes_per_token, "matmul_params": b.matmul_params}
                 for n, b in benches.items()},
        "rows": [], "complete": False, "loadavg_start": os.getloadavg(),
        "run": run_info(command=sys.argv, device=args.device, dtype=dtype).to_json(),
    }

    def save() -> None:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, default=str)
        os.replace(tmp, args.out)

    t0 = time.time()
    for p in lens:
        for b in batches:
            points, roof = run_points_alternating(benches, b, p, args.new_tokens, args.reps, args.warmup,
                                                  prefill_once=not args.prefill_every_rep)
            bw, fl = roof["copy_bandwidth"], roof["matmul_flops"]
            rows = {n: {"model": n, **points[n].to_json()} for n in names}
            for n in names:
                rows[n]["roof"] = {"copy_bandwidth_gbs": bw / 1e9, "matmul_gflops": fl / 1e9,
                                   "ridge_flops_per_byte": fl / bw}
                b0 = base_of[n]
                if n != b0 and rows[n]["status"] == "ok" and rows[b0]["status"] == "ok":
                    rows[n]["comparison"] = compare(rows[b0], rows[n])
                data["rows"].append(rows[n])
            data["elapsed_s"] = time.time() - t0
            save()
            for n in names:
                r = rows[n]
                c = r.get("comparison")
                print(f"b{b:<3} p{p:<5} {n:>12} {r['status']}"
                      + (f" {r['decode_ms_per_token']['median']:8.1f} ms/step {100 * r['roofline_fraction']:4.0f}% of copy"
                         if r["status"] == "ok" else "")
                      + (f"  speedup {c['measured_speedup']:.2f}x of predicted {c['predicted_speedup_bytes']:.2f}x"
                         if c else "")
                      + ("  DIFFERENT DECODE PATHS: " + str(c["paths_differ"]) if c and c["paths_differ"] else ""),
                      file=sys.stderr, flush=True)
    data["complete"] = True
    data["loadavg_end"] = os.getloadavg()
    save()
    table = markdown(data)
    print("\n" + table)
    if args.md:
        Path(args.md).write_text(table)


if __name__ == "__main__":
    main()
