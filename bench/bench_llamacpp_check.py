"""Serving check of GGUF files in llama.cpp (the gqakit engine `llama.cpp`) against transformers.

For each GGUF: llama.cpp generates greedily (N prompts of WikiText-2 test text, T tokens);
transformers loads the same file (`from_pretrained(dir, gguf_file=...)`, dequantised to
float32) and scores prompt + llama.cpp's tokens teacher-forced. The check, its margins and its
rule are `gqakit.engines.check` (what `gqakit eval X.gguf --engine llama.cpp --check` runs):
the margin follows the GGUF's coarsest matmul weight type (`gguf_quant`), and on quantised
weights agreement is reported, not required (`QUANTISED_RULE`). Per GGUF the entry also keeps
the gaps of every mismatch and the largest |log-prob difference| of the generated tokens.

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


def check(path: Path, prompts: int, prompt_len: int, tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from gqakit.engines import get_engine
    from gqakit.engines.base import EngineOptions
    from gqakit.engines.check import run_check
    from gqakit.eval.measures.serving import gguf_quant

    engine = get_engine("llama.cpp")
    engine.load(path, EngineOptions(max_len=prompt_len + tokens, threads=threads))
    try:
        text = WIKI.read_text()[:50_000] if WIKI.is_file() else "The quick brown fox jumps over the lazy dog. " * 500
        ids = engine.llm.tokenize(text.encode(), add_bos=False)
        step = len(ids) // prompts
        asked = [[engine.llm.token_bos(), *ids[i * step:i * step + prompt_len - 1]] for i in range(prompts)]
        quant = gguf_quant(path.parent, path.name)
        teacher = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        c = run_check(path, engine, teacher, dtype="float32", prompts=asked, new_tokens=tokens,
                      prompt_source="WikiText-2 test" if WIKI.is_file() else "repeated sentence", quant=quant)
    finally:
        engine.close()
    out = c.model_dump()
    out.update(gguf=path.name, weights=quant, prompt_len=prompt_len, agree=c.positions - len(c.mismatches))
    return out


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
        gaps = [m["margin"] for m in r["mismatches"]]
        say(f"{r['gguf']} ({r['weights']}): {r['agree']}/{r['positions']} agree, {len(gaps)} mismatches "
            f"(largest gap {max(gaps, default=0):.3g}, {r['unexplained']} over the {r['margin_row']} margin "
            f"{r['margin']}), max |dlogprob| {r['max_abs_logprob_diff']:.3g}, KV {r['kv']['allocated_bytes_per_token']} "
            f"B/token (predicted {r['kv']['predicted_bytes_per_token']}): {'pass' if r['passed'] else 'FAIL'}")
        rows.append(r)
    out = {"llama_cpp_python": llama_cpp.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d"), "threads": a.threads, "results": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
