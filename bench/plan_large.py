"""The uptraining memory plan of Llama-2-7B- and 70B-shaped GQA models, built with fake tensors.

The same plan `gqakit uptrain CONFIG --dry-run` prints, for shapes nobody here can load:
all weights, attention only, and LoRA (r 8 on K and V, the default after `mean`; and on Q,
K, V and O, the default after the `align` methods), with and without gradient
checkpointing, on one 80 GB GPU and on eight with FSDP; bf16 autocast, AdamW. Nothing is
downloaded or allocated.

    python -m bench.plan_large                     # the Markdown table of docs/benchmarks.md
    python -m bench.plan_large --seq-len 4096 --micro-batch 1 --details
"""

from __future__ import annotations

import argparse
import re

from gqakit.uptrain.plan import (ATTENTION, LoraPlan, Settings, Target, describe, gib, make_plan, device_memory_size,
                                 suggestions)

# The published shapes, converted to 8 KV heads (Llama-2-70B's own GQA; 7B: G = 8 too).
SHAPES = {
    "Llama-2-7B (G=8)": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                             intermediate_size=11008, vocab_size=32000),
    "Llama-2-70B (G=8)": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                              intermediate_size=28672, vocab_size=32000),
}


KV = ("self_attn.k_proj", "self_attn.v_proj")
QKVO = ("self_attn.q_proj", *KV, "self_attn.o_proj")
# what trains: (label, train.trainable, train.lora)
MODES = [("all weights", None, None), ("attention", tuple(ATTENTION), None),
         ("LoRA r 8, K V", None, LoraPlan(8, 16.0, 0.0, KV)), ("LoRA r 8, Q K V O", None, LoraPlan(8, 16.0, 0.0, QKVO))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--device-memory", default="80GB")
    ap.add_argument("--details", action="store_true", help="also print every plan part by part")
    args = ap.parse_args()
    from transformers import LlamaConfig

    mem = device_memory_size(args.device_memory)
    targets = {f"1 x {args.device_memory}": Target(1, "none", "cuda"),
               f"8 x {args.device_memory}, FSDP": Target(8, "fsdp", "cuda")}
    print(f"seq_len {args.seq_len} x micro_batch {args.micro_batch}, bf16 autocast, AdamW; peak per GPU without / "
          f"with gradient checkpointing (`python -m bench.plan_large`)\n")
    print("| model | trained | " + " | ".join(targets) + " | or with |")
    print("|---|---|" + "---|" * len(targets) + "---|")
    for name, shape in SHAPES.items():
        cfg = LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False)
        for what, trainable, lora in MODES:
            cells, hows, details = [], [], []
            for label, target in targets.items():
                def plan(ckpt: bool):
                    s = Settings(args.seq_len, args.micro_batch, 1, ckpt, trainable, "bf16", lora)
                    return make_plan(cfg, s, target)

                full, ckpt = plan(False), plan(True)
                fits = "yes" if full.peak <= mem else ("with checkpointing" if ckpt.peak <= mem else "no")
                cells.append(f"{gib(full.peak)} / {gib(ckpt.peak)}, {fits}")
                if ckpt.peak > mem:
                    hows += [f"{label.split(',')[0]}: {re.sub(r' [(]configs/[^)]*[)]', '', h)}"
                             for h in suggestions(ckpt, mem)]
                if args.details:
                    details.append("\n".join(describe(full, name, [(label, mem)], {})))
            n = f"{full.trained / 1e9:.2f} B" if full.trained >= 1e9 else f"{full.trained / 1e6:.1f} M"
            print(f"| {name} | {what} ({n}) | " + " | ".join(cells) + f" | {'; '.join(hows)} |",
                  flush=True)
            for d in details:
                print("\n```\n" + d + "\n```\n")


if __name__ == "__main__":
    main()
