"""The uptraining memory plan of Llama-2-7B- and 70B-shaped GQA models, built with fake tensors.

The same plan `gqakit uptrain CONFIG --dry-run` prints, for shapes nobody here can load:
all weights and attention only, with and without gradient checkpointing, on one 80 GB
GPU and on eight with FSDP; bf16 autocast, AdamW. Nothing is downloaded or allocated.

    python -m bench.plan_large                     # the Markdown table of docs/benchmarks.md
    python -m bench.plan_large --seq-len 4096 --micro-batch 1 --details
"""

from __future__ import annotations

import argparse

from gqakit.uptrain.plan import ATTENTION, Settings, Target, describe, gib, make_plan, parse_size, suggestions

# The published shapes, converted to 8 KV heads (Llama-2-70B's own GQA; 7B: G = 8 too).
SHAPES = {
    "Llama-2-7B (G=8)": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             intermediate_size=11008, vocab_size=32000),
    "Llama-2-70B (G=8)": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                              intermediate_size=28672, vocab_size=32000),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--device-memory", default="80GB")
    ap.add_argument("--details", action="store_true", help="also print every plan part by part")
    args = ap.parse_args()
    from transformers import LlamaConfig

    mem = parse_size(args.device_memory)
    targets = {f"1 x {args.device_memory}": Target(1, "none", "cuda"),
               f"8 x {args.device_memory}, FSDP": Target(8, "fsdp", "cuda")}
    print(f"seq_len {args.seq_len} x micro_batch {args.micro_batch}, bf16 autocast, AdamW; peak per GPU "
          f"(`python -m bench.plan_large`)\n")
    print("| model | trained | GPUs | no checkpointing | gradient checkpointing | fits | or with |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        cfg = LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False)
        for what, trainable in (("all weights", None), ("attention", tuple(ATTENTION))):
            for label, target in targets.items():
                s = Settings(args.seq_len, args.micro_batch, 1, False, trainable, "bf16")
                plan = make_plan(cfg, s, target)
                ckpt = make_plan(cfg, Settings(args.seq_len, args.micro_batch, 1, True, trainable, "bf16"), target)
                fits = "yes" if plan.peak <= mem else ("with checkpointing" if ckpt.peak <= mem else "no")
                how = "" if ckpt.peak <= mem else "; ".join(suggestions(ckpt, mem))
                print(f"| {name} | {what} ({plan.trained / 1e9:.2f} B) | {label} | {gib(plan.peak)} | "
                      f"{gib(ckpt.peak)} | {fits} | {how} |", flush=True)
                if args.details:
                    print("\n```\n" + "\n".join(describe(plan, name, [(label, mem)], {})) + "\n```\n")


if __name__ == "__main__":
    main()
