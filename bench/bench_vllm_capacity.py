"""vLLM serving check and capacity at a fixed KV budget: an original model vs its conversion.

Both models are loaded into vLLM (gqakit's vLLM engine, `gqakit.engines.vllm`) with the same
KV-cache memory (`--kv-budget`, vLLM's `kv_cache_memory_bytes`). For each:

- the serving check: greedy tokens on `--check-prompts` WikiText-2 windows (fixed token ids
  when ../shared is absent), scored teacher-forced by transformers on the same folder: a
  position agrees when vLLM's token is transformers' argmax; a mismatch is a near-tie when
  transformers' log-prob of its argmax exceeds its log-prob of vLLM's token by less than the
  dtype's margin (`NEAR_TIE`); also the largest |vLLM logprob - transformers logprob| of the
  chosen tokens, and vLLM's allocated KV bytes per token vs gqakit's prediction
  (2 x layers x KV heads x head_dim x cache-dtype bytes, from the architecture table);
- capacity: vLLM's KV blocks x block size, and its maximum concurrency at the workload's
  context (prompt + output, in whole blocks per sequence);
- throughput of one fixed workload: `--requests` prompts of `--prompt` tokens, `--output`
  greedy tokens each, all submitted at once; `--runs` timed runs per model after one warm-up,
  alternating between the models so that the machine's load changes touch both alike.

The prediction from bytes: the concurrency ratio is the KV-bytes-per-token ratio (block
rounding aside); the throughput ratio is at most the ratio of sequences that run at once
(min(requests, concurrency)), reached when a decode step costs the same at any batch size
(the weights' reads dominate), as on a memory-bound machine.

    .venv/bin/python -m bench.bench_vllm_capacity /work/assets/smollm2-g3 /work/assets/smollm2-g1 \\
        --kv-budget 64MiB --requests 32 --prompt 128 --output 32 --runs 3

Needs vLLM (`bash scripts/engines.sh vllm`); writes bench/results/vllm_capacity.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, SHARED, say, write_json
from gqakit.core import arch
from gqakit.core.units import DTYPE_BYTES, parse_size
from gqakit.engines import EngineOptions, get_engine
from gqakit.engines.vllm import max_concurrency

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WIKI = SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw"
# A mismatch is explained by a near-tie when transformers' own argmax beats vLLM's token by
# less than this many nats. float32: both engines sum in float32 in different orders, so a
# logit differs by ~1e-5 relative; 1e-3 nats leaves a wide margin over that and still calls
# any real disagreement a failure. bfloat16/float16: 8/11-bit mantissas, a logit's rounding
# alone is ~0.05/0.01 nats on logits of size ~10.
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.03}


def predicted_kv_bytes(model: Path, cache_bytes: int) -> int:
    """gqakit's KV bytes per token of MODEL: 2 x layers x KV heads x head_dim x CACHE_BYTES."""
    config = json.loads((Path(model) / "config.json").read_text())
    return arch.shape_of(arch.lookup(config), config).kv_bytes_per_token(cache_bytes)


def check_prompts(model: Path, n: int, length: int) -> list[list[int]]:
    """N windows of LENGTH token ids of WikiText-2 test text (the model's tokenizer), spread over
    the text; fixed ids when the text is absent."""
    if WIKI.is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        ids = tok(WIKI.read_text()[:200_000], add_special_tokens=False)["input_ids"]
        step = (len(ids) - length) // n
        return [ids[i * step: i * step + length] for i in range(n)]
    config = json.loads((Path(model) / "config.json").read_text())
    return workload_prompts(n, length, int(config["vocab_size"]), seed=1)


def workload_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """N distinct prompts of LENGTH ids (a fixed arithmetic pattern, away from the special ids 0-2)."""
    return [[(7919 * b + 31 * i + 104729 * seed) % (vocab - 3) + 3 for i in range(length)] for b in range(n)]


def score(positions: list[dict[str, Any]], margin: float) -> dict[str, Any]:
    """Agreement, near-tie explanations and the largest logprob difference of scored POSITIONS
    (each: engine token, reference argmax, margin = ref lp(argmax) - ref lp(engine token),
    logprob_diff = |engine lp - reference lp| of the engine's token, when the engine gave one)."""
    mism = [p for p in positions if p["engine"] != p["argmax"]]
    unexplained = [p for p in mism if p["margin"] >= margin]
    diffs = [p["logprob_diff"] for p in positions if p.get("logprob_diff") is not None]
    agree = 1 - len(mism) / len(positions)
    return {"positions": len(positions), "agreement": agree, "mismatches": mism, "unexplained": len(unexplained),
            "near_tie_margin": margin, "max_logprob_diff": max(diffs) if diffs else None,
            "tokens_pass": agree >= 0.99 and not unexplained}


def teacher_forced(model: Path, prompts: list[list[int]], tokens: list[list[int]],
                   logprobs: list[list[float]] | None, dtype: str) -> list[dict[str, Any]]:
    """Each generated position scored by transformers on prompt + the engine's tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    out = []
    with torch.no_grad():
        for i, (prompt, gen) in enumerate(zip(prompts, tokens)):
            ids = torch.tensor([prompt + gen])
            lp = torch.log_softmax(lm(ids).logits[0].float(), dim=-1)[len(prompt) - 1: len(prompt) - 1 + len(gen)]
            for j, t in enumerate(gen):
                best = int(lp[j].argmax())
                row = {"prompt": i, "step": j, "engine": t, "argmax": best, "margin": float(lp[j, best] - lp[j, t])}
                if logprobs is not None:
                    row["logprob_diff"] = abs(float(logprobs[i][j]) - float(lp[j, t]))
                out.append(row)
    return out


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(models: dict[str, dict[str, Any]], requests: int) -> dict[str, Any]:
    """Converted vs original: measured ratios and the predictions from bytes."""
    a, b = models["original"], models["converted"]
    running = {k: min(requests, math.floor(m["concurrency"])) for k, m in models.items()}
    tput = {k: m["throughput_tok_s"]["median"] for k, m in models.items()}
    return {"kv_bytes_ratio": a["kv_bytes_per_token"] / b["kv_bytes_per_token"],
            "blocks_ratio": b["num_blocks"] / a["num_blocks"],
            "concurrency_ratio": b["concurrency"] / a["concurrency"],
            "concurrency_within_a_block": abs(b["num_blocks"] - a["num_blocks"] * a["kv_bytes_per_token"]
                                              / b["kv_bytes_per_token"]) <= 1,
            "running_at_once": running,
            "throughput_ratio": tput["converted"] / tput["original"],
            "throughput_ratio_predicted_max": running["converted"] / running["original"],
            "throughput_ratio_range": [b["throughput_tok_s"]["min"] / a["throughput_tok_s"]["max"],
                                       b["throughput_tok_s"]["max"] / a["throughput_tok_s"]["min"]]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("original", type=Path)
    ap.add_argument("converted", type=Path)
    ap.add_argument("--kv-budget", default="64MiB", help="KV-cache memory each model gets (default 64MiB)")
    ap.add_argument("--dtype", default="float32", choices=sorted(NEAR_TIE))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--check-prompts", type=int, default=6)
    ap.add_argument("--check-length", type=int, default=48)
    ap.add_argument("--check-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "vllm_capacity.json")
    args = ap.parse_args(argv)
    budget = parse_size(args.kv_budget, gb=1024, what="--kv-budget")
    context = args.prompt + args.output
    options = EngineOptions(dtype=args.dtype, max_len=max(context, args.check_length + args.check_tokens),
                            kv_budget_bytes=budget, max_batch=args.requests, threads=args.threads)
    paths = {"original": args.original, "converted": args.converted}
    engines, models, checks = {}, {}, {}
    try:
        for name, path in paths.items():
            say(f"loading {name} ({path}) into vLLM")
            engines[name] = eng = get_engine("vllm")
            eng.load(path, options)
            prompts = check_prompts(path, args.check_prompts, args.check_length)
            gen = eng.generate(prompts, args.check_tokens)
            checks[name] = (prompts, gen)
            kv = eng.kv_allocation()
            models[name] = {"model": str(path), "kv_bytes_per_token": kv.bytes_per_token,
                            "kv_bytes_predicted": predicted_kv_bytes(path, DTYPE_BYTES[args.dtype]),
                            "capacity_tokens": kv.capacity_tokens, "kv_total_bytes": kv.total_bytes,
                            "num_blocks": kv.detail["num_blocks"], "block_size": kv.detail["block_size"],
                            "concurrency": max_concurrency(kv, context), "vllm": eng.info.get("vllm"),
                            "seconds": []}
            say(f"{name}: {kv.detail['num_blocks']} blocks of {kv.detail['block_size']} tokens, "
                f"{kv.bytes_per_token} KV bytes/token")
        vocab = {n: int(json.loads((p / "config.json").read_text())["vocab_size"]) for n, p in paths.items()}
        for run in range(args.runs + 1):  # run 0 warms up
            for name, eng in engines.items():
                gen = eng.generate(workload_prompts(args.requests, args.prompt, vocab[name], seed=run), args.output)
                if run:
                    models[name]["seconds"].append(gen.seconds)
                say(f"run {run}{' (warm-up)' if not run else ''} {name}: {gen.seconds:.1f} s")
    finally:
        for eng in engines.values():
            eng.close()
    for name, path in paths.items():
        prompts, gen = checks[name]
        say(f"scoring {name} in transformers")
        m = models[name]
        m["check"] = score(teacher_forced(path, prompts, gen.tokens, gen.logprobs, args.dtype), NEAR_TIE[args.dtype])
        m["check"]["kv_pass"] = m["kv_bytes_per_token"] == m["kv_bytes_predicted"]
        m["throughput_tok_s"] = spread([args.requests * args.output / s for s in m["seconds"]])
        m["seconds_spread"] = spread(m["seconds"])
    result = {
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype, "kv_budget_bytes": budget,
        "workload": {"requests": args.requests, "prompt": args.prompt, "output": args.output, "runs": args.runs,
                     "context": context},
        "check": {"prompts": args.check_prompts, "length": args.check_length, "tokens": args.check_tokens,
                  "text": str(WIKI) if WIKI.is_file() else "fixed ids"},
        "models": models, "summary": summarize(models, args.requests)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    s = result["summary"]
    say(f"concurrency x{s['concurrency_ratio']:.2f} (KV bytes x{s['kv_bytes_ratio']:.2f}); throughput "
        f"x{s['throughput_ratio']:.2f} (at most x{s['throughput_ratio_predicted_max']:.2f} from bytes); "
        f"wrote {args.out}")
    return result


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
