"""A model with a real checkpoint's shape and random weights, for speed benchmarks (no Hub here).

Decode speed depends on shapes, not on weight values; this writes a folder that
`load_causal_lm` and the benchmarks read (config + safetensors, fp32, random normal weights with
sigma 0.02, norms at 1; never zeros), for shapes whose real checkpoints cannot be fetched here.

    .venv/bin/python -m bench.random_model gpt2-124m /tmp/rand/gpt2
    .venv/bin/python -m bench.random_model pythia-160m /tmp/rand/pythia

OUT must not exist: nothing is ever written over.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# name -> (transformers config class, its arguments): the published configs' shapes
SHAPES = {
    "gpt2-124m": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)),
    "opt-125m": ("OPTConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072,
                                   word_embed_proj_dim=768, max_position_embeddings=2048, vocab_size=50272,
                                   do_layer_norm_before=True)),
    "pythia-160m": ("GPTNeoXConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                          intermediate_size=3072, rotary_pct=0.25, vocab_size=50304,
                                          max_position_embeddings=2048, use_parallel_residual=True,
                                          tie_word_embeddings=False)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        sys.exit(f"random_model: {out} exists; name a new folder")

    import torch
    import transformers

    cls, kw = SHAPES[args.shape]
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    model.save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main()
