"""llama.cpp's own decode speed on an original GGUF and its gqakit conversion.

Converts SmolLM2-135M-Instruct Q4_1 (3 KV heads) to 1 KV head with
`gqakit convert SRC.gguf OUT.gguf -g 1` (unless --converted is given), then, for each
model in alternating rounds, loads it with llama-cpp-python, fills the context with
`--context` tokens of WikiText-2 test text (prefill), and decodes `--decode` more tokens
one at a time (each `eval` of one token is a real decode step over the filled KV cache).
The decode speed is llama.cpp's own: `llama_perf_context` (t_eval_ms / n_eval of the
decode steps only, the prefill excluded by a perf reset before decoding). The KV-cache
size is llama.cpp's own too (`llama_state_get_size` grows with it; reported as the
computed n_ctx x layers x KV heads x head_dim x 2 x 2 bytes for an F16 cache).

    .venv/bin/python -m bench.bench_llamacpp_decode --context 4096 --decode 64 --rounds 2 --threads 1

Needs `pip install llama-cpp-python` (gqakit[llama]); writes bench/results/llamacpp_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from bench.common import RESULTS, SHARED, SMOLLM2

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WIKI = SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw"


def measure(llama_cpp, path: Path, ids: list[int], decode: int, threads: int) -> dict:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(ids) + decode + 8, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill = time.perf_counter() - t0
    llama_cpp.llama_perf_context_reset(llm.ctx)
    import numpy as np

    def last_argmax() -> int:  # greedy next token from the last position's logits
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).argmax())

    tok = last_argmax()
    t0 = time.perf_counter()
    for _ in range(decode):
        llm.eval([tok])
        tok = last_argmax()
    wall = time.perf_counter() - t0
    perf = llama_cpp.llama_perf_context(llm.ctx)
    meta = llm.metadata
    kv = int(meta.get("llama.attention.head_count_kv", 0))
    layers, heads, emb = (int(meta[f"llama.{k}"]) for k in ("block_count", "attention.head_count", "embedding_length"))
    out = {"prefill_tokens": len(ids), "prefill_s": round(prefill, 3), "decode_tokens": decode,
           "decode_wall_s": round(wall, 4), "llama_cpp_n_eval": int(perf.n_eval),
           "llama_cpp_t_eval_ms": round(float(perf.t_eval_ms), 3),
           "decode_tok_per_s": round(1000.0 * perf.n_eval / perf.t_eval_ms, 2) if perf.t_eval_ms else None,
           "kv_heads": kv, "kv_cache_bytes_f16": llm.n_ctx() * layers * kv * (emb // heads) * 2 * 2}
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=SMOLLM2)
    ap.add_argument("--converted", type=Path, default=None, help="an existing conversion (default: convert now)")
    ap.add_argument("--g", type=int, default=1)
    ap.add_argument("--method", default="mean")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads; on a loaded CPU, more threads than free cores make its "
                         "spinning thread pool far slower (measured here: 2.6 s per token with 2, 58 ms with 1)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-llamacpp-bench"))
    ap.add_argument("--out", type=Path, default=RESULTS / "llamacpp_decode.json")
    a = ap.parse_args()
    import llama_cpp

    converted = a.converted
    if converted is None:
        from gqakit.convert import convert_gguf

        converted = a.workdir / f"{a.source.stem}-g{a.g}-{a.method}.gguf"
        if not converted.is_file():
            t0 = time.perf_counter()
            convert_gguf(a.source, converted, a.g, a.method, progress=False)
            print(f"converted in {time.perf_counter() - t0:.1f} s: {converted}", file=sys.stderr)
    tok = llama_cpp.Llama(model_path=str(a.source), n_ctx=64, vocab_only=True, verbose=False)
    text = WIKI.read_text()[:200_000] if WIKI.is_file() else " ".join(["The quick brown fox."] * 20000)
    ids = tok.tokenize(text.encode(), add_bos=True)[:a.context]
    if len(ids) < a.context:
        raise SystemExit(f"only {len(ids)} tokens of text for --context {a.context}")
    runs: dict[str, list[dict]] = {"original": [], "converted": []}
    for r in range(a.rounds):  # alternating, so machine drift hits both alike
        for name, path in (("original", a.source), ("converted", converted)):
            m = measure(llama_cpp, path, ids, a.decode, a.threads)
            runs[name].append(m)
            print(f"round {r + 1} {name:9s} kv_heads {m['kv_heads']} decode {m['decode_tok_per_s']} tok/s "
                  f"(prefill {m['prefill_s']} s)", file=sys.stderr)
    med = {k: statistics.median(x["decode_tok_per_s"] for x in v) for k, v in runs.items()}
    ratios = [c["decode_tok_per_s"] / o["decode_tok_per_s"] for o, c in zip(runs["original"], runs["converted"])]
    result = {"source": a.source.name, "converted": converted.name, "g": a.g, "method": a.method,
              "context": a.context, "decode": a.decode, "threads": a.threads, "rounds": a.rounds,
              "llama_cpp_python": llama_cpp.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "median_decode_tok_per_s": med, "speedup_per_round": [round(x, 3) for x in ratios],
              "speedup_median": round(statistics.median(ratios), 3), "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    o, c = runs["original"][0], runs["converted"][0]
    print(f"| model | KV heads | KV cache (F16, n_ctx {o['prefill_tokens'] + a.decode + 8}) | decode tok/s (median of "
          f"{a.rounds}) |\n|---|---|---|---|\n"
          f"| {a.source.name} | {o['kv_heads']} | {o['kv_cache_bytes_f16'] / 2**20:.1f} MiB | {med['original']:.1f} |\n"
          f"| {converted.name} | {c['kv_heads']} | {c['kv_cache_bytes_f16'] / 2**20:.1f} MiB | {med['converted']:.1f} |\n"
          f"\nspeedup per round {result['speedup_per_round']}, median {result['speedup_median']}x")


if __name__ == "__main__":
    main()
