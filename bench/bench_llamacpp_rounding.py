"""How much llama.cpp's 8-bit activation rounding moves a GGUF's log-probs, measured in
transformers alone: why a quantised GGUF's serving check can fail where the float one passes.

llama.cpp multiplies a quantised weight (Q4_0/Q4_1/Q5/Q8_0, K-quants) by activations it first
rounds to 8 bits per block of 32 values (Q8_0/Q8_1: a step of the block's largest |value| /
127). transformers multiplies the same dequantised weights by float32 activations. This script
loads each GGUF in transformers twice over the same WikiText-2 windows: as it is, and with
every linear layer's input rounded as llama.cpp rounds it (a forward pre-hook on each
nn.Linear). It reports, per GGUF, how far the rounding moves the log-prob of the plain run's
argmax (largest and mean, nats), how often it changes the argmax, the plain run's gap between
its two best tokens (a flat distribution has small gaps) and its WikiText NLL.

    python -m bench.bench_llamacpp_rounding --gguf SmolLM2.Q4_1.gguf --gguf g1.Q4_1.gguf

Writes bench/results/llamacpp_rounding.json. Needs the `gguf` package (transformers' GGUF loader).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.common import RESULTS, SHARED, say

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WIKI = SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw"
BLOCK = 32  # llama.cpp's Q8_0 / Q8_1 block


def round_like_q8(x):
    """x rounded to 8 bits per block of 32 along the last axis, as llama.cpp's Q8_0 quantises
    a matmul's activations (scale = block max |x| / 127, values round to the nearest step)."""
    import torch

    shape = x.shape
    b = x.float().reshape(-1, shape[-1] // BLOCK, BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(b / torch.where(d > 0, d, 1)) * d, b)
    return q.reshape(shape).to(x.dtype)


def measure(path: Path, windows: int, length: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = WIKI.read_text()[:50_000] if WIKI.is_file() else "The quick brown fox jumps over the lazy dog. " * 500
    ids = tok(text, add_special_tokens=False)["input_ids"]
    step = (len(ids) - length) // windows
    batch = torch.tensor([ids[i * step:i * step + length] for i in range(windows)])

    def hook(_module, args):
        x = args[0]
        if x.shape[-1] % BLOCK:
            return None
        return (round_like_q8(x), *args[1:])

    with torch.inference_mode():
        plain = torch.log_softmax(model(batch).logits.float(), -1)
        handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
        try:
            rounded = torch.log_softmax(model(batch).logits.float(), -1)
        finally:
            for h in handles:
                h.remove()
    best = plain.argmax(-1, keepdim=True)
    moved = (plain.gather(-1, best) - rounded.gather(-1, best)).abs().squeeze(-1)
    top2 = plain.topk(2, -1).values
    gaps = top2[..., 0] - top2[..., 1]
    nll = -plain[:, :-1].gather(-1, batch[:, 1:, None]).mean()
    return {"gguf": path.name, "windows": windows, "length": length, "positions": int(moved.numel()),
            "max_abs_logprob_move": round(float(moved.max()), 4), "mean_abs_logprob_move": round(float(moved.mean()), 4),
            "argmax_changed": int((rounded.argmax(-1) != best.squeeze(-1)).sum()),
            "median_top2_gap": round(float(gaps.median()), 4), "wikitext_nll": round(float(nll), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, action="append", required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--out", type=Path, default=RESULTS / "llamacpp_rounding.json")
    a = ap.parse_args()
    rows = []
    for path in a.gguf:
        r = measure(path, a.windows, a.length)
        say(json.dumps(r))
        rows.append(r)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "text": str(WIKI) if WIKI.is_file() else "fixed",
                                 "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
