"""Serving check of GGUF files in llama.cpp (the gqakit engine `llama.cpp`) against transformers.

For each GGUF: llama.cpp generates greedily (N prompts of WikiText-2 test text, T tokens);
transformers loads the same file (`from_pretrained(dir, gguf_file=...)`, dequantised to
float32) and scores prompt + llama.cpp's tokens teacher-forced. A position agrees when
llama.cpp's token is transformers' argmax; a mismatch is a near-tie when transformers'
log-prob of its own argmax minus its log-prob of llama.cpp's token is under the margin of the
GGUF's weight type (MARGINS). Teacher-forced: after a mismatch, transformers goes on scoring
llama.cpp's own text. Pass: >= 99% agree, every mismatch a near-tie, KV bytes as predicted. Also: the largest |log-prob difference| of the generated tokens,
and llama.cpp's KV bytes per token against 2 x layers x KV heads x head_dim x 2 (F16 cache).

    python -m bench.bench_llamacpp_check --gguf SmolLM2.Q4_1.gguf --gguf g1.Q4_1.gguf --prompts 8 --tokens 16

Needs gqakit[llamacpp]; writes bench/results/llamacpp_check.json (one entry per GGUF).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from bench.common import RESULTS, SHARED, say

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WIKI = SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw"

# Largest transformers log-prob gap (nats) a mismatch may have and still count as a near-tie,
# by the GGUF's matmul weight type. llama.cpp computes a quantised matmul on activations it
# quantises to 8 bits per 32-value block (Q8_0 / Q8_1: a relative step of 2^-7 of the block's
# largest value), and its cache holds K and V in F16; transformers multiplies the dequantised
# weights by float32 activations. So a Q4/Q5/Q8 GGUF moves every logit by the 8-bit rounding
# of each matmul input, summed through the layers: tenths of a nat on SmolLM2-135M
# (bench/results/llamacpp_check.json, `max_abs_logprob_diff`), and 0.5 nat is the margin. F32
# and F16 weights keep float activations; only the F16 cache rounds (2^-11 relative), and
# 0.05 nat is the margin.
MARGINS = {"F32": 0.05, "F16": 0.05, "BF16": 0.05, "Q8_0": 0.5, "Q4_0": 0.5, "Q4_1": 0.5, "Q5_0": 0.5,
           "Q5_1": 0.5}


def matmul_type(counts: dict[str, int]) -> str:
    """The GGUF's quantisation: its most frequent type of weight tensor (1-D tensors are F32)."""
    return max(counts, key=counts.get)


def check(path: Path, prompts: int, prompt_len: int, tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from gqakit.engines import get_engine
    from gqakit.engines.base import EngineOptions

    engine = get_engine("llama.cpp")
    engine.load(path, EngineOptions(max_len=prompt_len + tokens, threads=threads))
    text = WIKI.read_text()[:50_000] if WIKI.is_file() else "The quick brown fox jumps over the lazy dog. " * 500
    ids = engine.llm.tokenize(text.encode(), add_bos=False)
    step = len(ids) // prompts
    asked = [[engine.llm.token_bos(), *ids[i * step:i * step + prompt_len - 1]] for i in range(prompts)]
    gen = engine.generate(asked, tokens)
    kv = engine.kv_allocation()
    qtype = matmul_type(engine.weight_types())
    engine.close()
    say(f"{path.name}: llama.cpp generated {prompts} x {tokens} tokens in {gen.seconds:.1f} s; transformers scores")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    margin = MARGINS[qtype]
    positions, agree, mismatches, worst = 0, 0, [], 0.0
    for prompt, got, lps in zip(asked, gen.tokens, gen.logprobs):
        with torch.no_grad():
            lp = model(torch.tensor([prompt + got])).logits[0].float().log_softmax(-1)[len(prompt) - 1:-1]
        for i, (t, elp) in enumerate(zip(got, lps)):
            positions += 1
            worst = max(worst, abs(float(lp[i, t]) - elp))
            if int(lp[i].argmax()) == t:
                agree += 1
                continue
            gap = float(lp[i].max() - lp[i, t])
            mismatches.append({"position": i, "token": t, "transformers": int(lp[i].argmax()), "gap": round(gap, 4),
                               "near_tie": gap < margin})
    predicted = kv.detail["predicted_bytes_per_token"]
    ok = agree >= 0.99 * positions and all(m["near_tie"] for m in mismatches) and kv.bytes_per_token == predicted
    return {"gguf": path.name, "weights": qtype, "margin": margin, "prompts": prompts, "prompt_len": prompt_len,
            "tokens": tokens, "positions": positions, "agree": agree, "agreement": round(agree / positions, 4),
            "mismatches": mismatches, "unexplained": sum(not m["near_tie"] for m in mismatches),
            "max_abs_logprob_diff": round(worst, 4), "kv_bytes_per_token": kv.bytes_per_token,
            "kv_predicted": predicted, "kv_capacity_tokens": kv.capacity_tokens, "kv_total_bytes": kv.total_bytes,
            "kv_detail": {k: kv.detail[k] for k in ("type_k", "type_v", "n_ctx", "layers")}, "passed": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, action="append", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "llamacpp_check.json")
    a = ap.parse_args()
    import llama_cpp

    rows = []
    for path in a.gguf:
        r = check(path, a.prompts, a.prompt_len, a.tokens, a.threads)
        say(f"{r['gguf']}: {r['agree']}/{r['positions']} agree, {len(r['mismatches'])} mismatches "
            f"({r['unexplained']} unexplained), max |dlogprob| {r['max_abs_logprob_diff']}, KV "
            f"{r['kv_bytes_per_token']} B/token (predicted {r['kv_predicted']}): {'pass' if r['passed'] else 'FAIL'}")
        rows.append(r)
    out = {"llama_cpp_python": llama_cpp.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "date": time.strftime("%Y-%m-%d"), "threads": a.threads, "results": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
