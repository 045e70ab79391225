"""Decode speed and KV cache, MHA vs GQA, measured in one run on one device.

Builds a Llama-shaped model with random weights (transformers' own initialisation, not
zeros; decode speed does not depend on what the weights say), directly on the device,
in versions that differ only in the number of KV heads (the MHA one and one per
`--kv-heads` value), and times them with gqakit's decode benchmark (static cache,
warm-up excluded, synchronized timing, median of repetitions). Grid points alternate
between the models so machine drift hits all alike.

Each GQA point is compared with the MHA one twice: the measured speedup (ratio of
per-token decode times) and the speedup predicted by bytes (ratio of the bytes a decode
step must read: all weights once plus the filled KV cache). A decode step that is
memory-bound and reaches the same fraction of bandwidth for both models gets the
predicted speedup; a step bound by kernel launches or Python gets less.

    .venv/bin/python -m bench.bench_decode                      # CPU-sized default
    .venv/bin/python -m bench.bench_decode --hidden 4096 --layers 32 --heads 32 --kv-heads 8,1 \
        --intermediate 11008 --vocab 32000 --batch 1,16,64 --prompt-len 512,2048 \
        --device cuda --dtype bfloat16 --cuda-graphs

Prints a Markdown table for docs/benchmarks.md (also written to `--md`) and writes the raw
numbers as JSON to `--out`, rewritten after every grid point so a run stopped early keeps
what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench.common import random_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def model_name(heads: int, kv: int) -> str:
    return f"{'MHA' if kv == heads else 'GQA'} ({kv} KV head{'s' if kv > 1 else ''})"


def comparisons(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (prompt, batch, GQA model): measured and predicted-by-bytes speedup over MHA."""
    heads = data["args"]["heads"]
    mha = model_name(heads, heads)
    by = {(r["model"], r["batch"], r["prompt_len"]): r for r in data["rows"]}
    out = []
    for r in data["rows"]:
        a = by.get((mha, r["batch"], r["prompt_len"]))
        if r["model"] == mha or a is None:
            continue
        row: dict[str, Any] = {"batch": r["batch"], "prompt_len": r["prompt_len"], "kv_heads": r["kv_heads"],
                               "mha_status": a["status"], "gqa_status": r["status"]}
        if a["status"] == "ok" and r["status"] == "ok":
            from gqakit.eval.speed.roofline import StepCost, predict_speedup, share

            ma, mg = a["decode_ms_per_token"]["median"], r["decode_ms_per_token"]["median"]
            predicted = predict_speedup(StepCost.of(a), StepCost.of(r)).bytes
            row.update({
                "mha_ms_per_token": ma, "gqa_ms_per_token": mg, "measured_speedup": ma / mg,
                "predicted_speedup_bytes": predicted,
                "share_of_predicted": share(ma / mg, predicted),
                "mha_kv_cache_bytes": a["kv_cache_bytes"], "gqa_kv_cache_bytes": r["kv_cache_bytes"],
                "mha_roofline_fraction": a["roofline_fraction"], "gqa_roofline_fraction": r["roofline_fraction"],
                "mha_memory_bound": a["memory_bound"], "gqa_memory_bound": r["memory_bound"],
            })
        out.append(row)
    return out


# gpt-fast's published decode figure (README, "Benchmarks": A100-80GB power-limited to 330 W,
# batch 1, torch.compile + CUDA graphs, bf16, no quantization): the reference for batch 1.
GPT_FAST = {"model": "Llama-2-7B", "device": "A100-80GB (330 W)", "tokens_per_s": 104.9, "bandwidth_gbs": 1397.31}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def decode_modes(data: dict[str, Any]) -> str:
    """How the decode steps ran (eager, compiled, CUDA graphs), and why graphs were dropped if they were."""
    modes = sorted({r.get("decode_mode", "eager") for r in data["rows"] if r["status"] == "ok"})
    text = ", ".join(modes) or ("compiled" if data["args"].get("compile") else "eager")
    errors = {e for e in data.get("graph_errors", {}).values() if e}
    if errors:
        text += " (CUDA graphs requested, fell back to eager: " + "; ".join(sorted(errors)) + ")"
    return text


def markdown(data: dict[str, Any]) -> str:
    """The description and table for docs/benchmarks.md, from the JSON this script writes."""
    a, roof, run = data["args"], data["roof"], data["run"]
    bw, fl = roof["copy_bandwidth"], roof["matmul_flops"]
    lines = [
        f"Device: {run['device_name']}, dtype {a['dtype']}, torch {run['torch']}, transformers "
        f"{run['transformers']}; copy bandwidth {bw / 1e9:.1f} GB/s, matmul {fl / 1e12:.1f} TFLOP/s "
        f"(ridge {fl / bw:.1f} FLOP/byte); grid took {data.get('elapsed_s', 0):.0f} s"
        + ("" if data.get("complete") else " (stopped before the grid was complete)") + ".",
        f"Model: Llama-shaped, random weights, hidden {a['hidden']}, {a['layers']} layers, {a['heads']} heads x "
        f"head_dim {a['hidden'] // a['heads']}, MLP {a['intermediate']}, vocab {a['vocab']}; "
        + ", ".join(f"{n}: {_count(data['params'][n])} params, {data['kv_bytes_per_token'][n] / 1024:g} KiB KV/token"
                    for n in data["params"]) + ".",
        f"Decode: {a['new_tokens']} new tokens after a random prompt, {a['warmup']} warm-up run(s) excluded, "
        f"median of {a['reps']}; decode steps: " + decode_modes(data) + ".",
        "Attention path: " + "; ".join(f"{n}: {p['decode_path']}" for n, p in data["probes"].items()) + ".",
        "",
        "| batch | prompt | G | KV cache MHA → GQA | MHA ms/token | GQA ms/token | measured speedup | "
        "predicted by bytes | share of predicted | MHA % of copy BW | GQA % of copy BW | memory-bound (MHA / GQA) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons(data):
        head = f"| {c['batch']} | {c['prompt_len']} | {c['kv_heads']} |"
        if "measured_speedup" not in c:
            lines.append(f"{head} | {c['mha_status']} | {c['gqa_status']} | | | | | | |")
            continue
        yn = lambda v: "yes" if v else "no"  # noqa: E731
        pct = lambda v: "n/a" if v is None else f"{100 * v:.0f}%"  # noqa: E731
        lines.append(
            f"{head} {c['mha_kv_cache_bytes'] / 2**20:,.1f} → {c['gqa_kv_cache_bytes'] / 2**20:,.1f} MiB | "
            f"{c['mha_ms_per_token']:.2f} | {c['gqa_ms_per_token']:.2f} | {c['measured_speedup']:.2f}× | "
            f"{c['predicted_speedup_bytes']:.2f}× | "
            f"{pct(c['share_of_predicted'])} | "
            f"{100 * c['mha_roofline_fraction']:.0f}% | "
            f"{100 * c['gqa_roofline_fraction']:.0f}% | {yn(c['mha_memory_bound'])} / {yn(c['gqa_memory_bound'])} |")
    mb = data.get("max_batch") or {}
    if mb:
        heads = a["heads"]
        lines += ["", f"Largest batch whose cache and one decode step fit at {a['max_batch_at']} + {a['new_tokens']} "
                  f"tokens ({next(iter(mb.values()))['method']}; all models loaded at once, so each search sees the "
                  "same free memory): " + "; ".join(
                      f"{n}: {m['max_batch']}{'+' if m['at_limit'] else ''}"
                      + (f" ({m['max_batch'] / mb[model_name(heads, heads)]['max_batch']:.2f}× MHA, H/G = "
                         f"{heads / data['kv_heads'][n]:g})" if n != model_name(heads, heads)
                         and mb.get(model_name(heads, heads), {}).get("max_batch") else "")
                      for n, m in mb.items()) + "."]
    b1 = [r for r in data["rows"] if r["status"] == "ok" and r["batch"] == 1]
    if b1:
        best = max(b1, key=lambda r: r["achieved_bandwidth_gbs"])
        lines += ["", f"Batch 1, best point: {best['model']} at prompt {best['prompt_len']}, "
                  f"{best['tokens_per_s']['median']:.1f} tok/s, {best['achieved_bandwidth_gbs']:.0f} GB/s = "
                  f"{100 * best['roofline_fraction']:.0f}% of this device's copy bandwidth. gpt-fast's published "
                  f"figure: {GPT_FAST['model']} on {GPT_FAST['device']}, {GPT_FAST['tokens_per_s']} tok/s, "
                  f"{GPT_FAST['bandwidth_gbs']:.0f} GB/s (its bandwidth counts weights only)."]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", default="2", help="KV heads of the GQA model(s), e.g. 8,1 (the MHA one has --heads)")
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt-len", default="256,1024")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay each decode step as a CUDA graph (no compilation; falls back to eager if capture fails)")
    ap.add_argument("--eager", action="store_true",
                    help="plain transformers steps: no packed CPU weights, SDPA decode attention (default: the fast path)")
    ap.add_argument("--max-batch-at", type=int, default=None,
                    help="also find each model's largest batch at this prompt length (cache + one decode step)")
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--md", default=None, help="also write the Markdown table to this file")
    return ap


def main() -> None:
    args = parser().parse_args()

    import torch

    from gqakit.eval.provenance import run_info
    from gqakit.eval.speed import DecodeBench, measure_roof, parse_ints

    dtype = getattr(torch, args.dtype)
    batches, lens = parse_ints(args.batch, "--batch"), parse_ints(args.prompt_len, "--prompt-len")
    kvs = [k for k in parse_ints(args.kv_heads, "--kv-heads") if k != args.heads]
    positions = max(lens) + args.new_tokens
    models = {model_name(args.heads, kv): kv for kv in [args.heads, *kvs]}
    benches = {}
    for name, kv in models.items():
        shape = {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                 "intermediate": args.intermediate, "vocab": args.vocab}
        m = random_llama(shape, kv, device=args.device, dtype=dtype, positions=positions)
        benches[name] = DecodeBench(m, device=args.device, dtype=dtype, compile=args.compile,
                                    cuda_graphs=args.cuda_graphs and not args.eager, pack_weights=not args.eager,
                                    decode_kernel="sdpa" if args.eager else "matmul")
    roof = measure_roof(args.device, dtype)
    data: dict[str, Any] = {
        "args": vars(args), "roof": roof, "probes": {n: b.probe() for n, b in benches.items()},
        "params": {n: sum(x.numel() for x in b.model.parameters()) for n, b in benches.items()},
        "kv_bytes_per_token": {n: b.kv_bytes_per_token for n, b in benches.items()}, "kv_heads": models,
        "rows": [], "comparisons": [], "complete": False, "elapsed_s": 0.0,
        "run": run_info(command=sys.argv, device=args.device, dtype=dtype).to_json(),
    }

    def save() -> None:
        data["comparisons"] = comparisons(data)
        data["graph_errors"] = {n: b.graph_error for n, b in benches.items()}
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, default=str)
        os.replace(tmp, args.out)  # a reader (or a kill) never sees half a file

    t0 = time.time()
    save()
    for p in lens:
        for b in batches:
            for name, bench in benches.items():
                # prefill once per point (decode repetitions rewind the cache): the budget goes to decode
                r = bench.run_point(b, p, args.new_tokens, args.reps, args.warmup, roof, prefill_once=True).to_json()
                data["rows"].append({"model": name, "kv_heads": models[name], **r})
                data["elapsed_s"] = time.time() - t0
                save()
                print(f"{name:>20} b{b:<3} p{p:<5} {r['status']}"
                      + (f" {r['tokens_per_s']['median']:8.1f} tok/s" if r["status"] == "ok" else ""),
                      file=sys.stderr, flush=True)
    if args.max_batch_at:
        data["max_batch"] = {}
        for name, bench in benches.items():
            # a cache of prompt + new tokens and one decode step at its end (no prefill)
            found = bench.max_batch(args.max_batch_at, args.new_tokens, 4096, prefill=False).to_json()
            data["max_batch"][name] = {k: found[k] for k in ("max_batch", "at_limit", "limit", "method")}
            save()
            print(f"{name:>20} max batch at {args.max_batch_at}: {data['max_batch'][name]['max_batch']}",
                  file=sys.stderr, flush=True)
    data["complete"] = True
    save()
    table = markdown(data)
    print("\n" + table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
