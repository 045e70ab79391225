"""Decode speed and KV cache, MHA vs GQA, measured in one run on one device.

Builds a Llama-shaped model with random weights (transformers' own initialisation, not
zeros; decode speed does not depend on what the weights say) in two versions that differ
only in the number of KV heads, and times both with gqakit's decode benchmark
(static cache, warm-up excluded, synchronized timing, median of repetitions). Grid
points alternate between the two models so machine drift hits both alike.

    .venv/bin/python bench/bench_decode.py                      # CPU-sized default
    .venv/bin/python bench/bench_decode.py --hidden 2048 --layers 16 --batch 1,16,64 \
        --prompt-len 512,4096 --new-tokens 128 --device cuda --dtype bfloat16 --compile

Prints a Markdown table for docs/benchmarks.md and writes the raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, positions: int,
          dtype, device, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                      max_position_embeddings=positions, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()
    assert all(p.abs().sum() > 0 for p in model.parameters() if p.dim() > 1), "weights must not be zeros"
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads of the GQA model (the MHA one has --heads)")
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
    ap.add_argument("--out", default="bench_decode.json")
    args = ap.parse_args()

    import torch

    from gqakit.eval.results import run_info
    from gqakit.eval.speed import DecodeBench, copy_bandwidth, matmul_flops, parse_ints

    dtype = getattr(torch, args.dtype)
    batches, lens = parse_ints(args.batch, "--batch"), parse_ints(args.prompt_len, "--prompt-len")
    positions = max(lens) + args.new_tokens
    models = {f"MHA ({args.heads} KV heads)": args.heads, f"GQA ({args.kv_heads} KV heads)": args.kv_heads}
    benches = {}
    for name, kv in models.items():
        m = build(args.hidden, args.layers, args.heads, kv, args.intermediate, args.vocab, positions, dtype, args.device)
        benches[name] = DecodeBench(m, device=args.device, dtype=dtype, compile=args.compile)
    bw, fl = copy_bandwidth(args.device), matmul_flops(args.device, dtype)
    roof = {"copy_bandwidth": bw, "matmul_flops": fl, "ridge_flops_per_byte": fl / bw}
    probes = {n: b.probe() for n, b in benches.items()}
    rows = []
    t0 = time.time()
    for p in lens:
        for b in batches:
            for name, bench in benches.items():
                r = bench.run_point(b, p, args.new_tokens, args.reps, args.warmup, roof)
                rows.append({"model": name, **r})
                print(f"{name:>20} b{b:<3} p{p:<5} {r['status']}"
                      + (f" {r['tokens_per_s']['median']:8.1f} tok/s" if r["status"] == "ok" else ""),
                      file=sys.stderr, flush=True)
    elapsed = time.time() - t0
    mha, gqa = list(benches)
    params = {n: sum(x.numel() for x in b.model.parameters()) for n, b in benches.items()}
    print(f"\nDevice: {run_info(command=None, device=args.device, dtype=dtype)['device_name']}, dtype {args.dtype}, "
          f"torch {torch.__version__}; copy bandwidth {bw / 1e9:.1f} GB/s, matmul {fl / 1e9:.0f} GFLOP/s "
          f"(ridge {fl / bw:.1f} FLOP/byte); grid took {elapsed:.0f} s.")
    print(f"Model: Llama-shaped, hidden {args.hidden}, {args.layers} layers, {args.heads} heads x head_dim "
          f"{args.hidden // args.heads}, MLP {args.intermediate}, vocab {args.vocab}; "
          + ", ".join(f"{n}: {params[n] / 1e6:.1f} M params, {benches[n].kv_bytes_per_token / 1024:.0f} KiB KV/token"
                      for n in benches) + ".")
    print(f"Attention path: " + "; ".join(f"{n}: {p['decode_path']}" for n, p in probes.items()) + ".\n")
    print("| batch | prompt | KV cache MHA → GQA (cache object) | MHA ms/token | GQA ms/token | speedup | "
          "MHA % of copy BW | GQA % of copy BW | memory-bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    by = {(r["model"], r["batch"], r["prompt_len"]): r for r in rows}
    for p in lens:
        for b in batches:
            a, g = by[(mha, b, p)], by[(gqa, b, p)]
            if a["status"] != "ok" or g["status"] != "ok":
                print(f"| {b} | {p} | | {a['status']} | {g['status']} | | | | |")
                continue
            ma, mg = a["decode_ms_per_token"]["median"], g["decode_ms_per_token"]["median"]
            print(f"| {b} | {p} | {a['kv_cache_bytes'] / 2**20:.1f} → {g['kv_cache_bytes'] / 2**20:.1f} MiB | "
                  f"{ma:.2f} | {mg:.2f} | {ma / mg:.2f}× | {100 * a['roofline_fraction']:.0f}% | "
                  f"{100 * g['roofline_fraction']:.0f}% | {'yes' if a['memory_bound'] else 'no'} / "
                  f"{'yes' if g['memory_bound'] else 'no'} |")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "roof": roof, "probes": probes, "params": params, "rows": rows,
                   "run": run_info(command=sys.argv, device=args.device, dtype=dtype)}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
