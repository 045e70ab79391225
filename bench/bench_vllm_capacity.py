"""vLLM serving check and capacity at a fixed KV budget: an original model vs its conversion.

Both models are loaded into vLLM (gqakit's vLLM engine, `gqakit.engines.vllm`) with the same
KV-cache memory (`--kv-budget`, vLLM's `kv_cache_memory_bytes`). For each:

- the serving check (`gqakit.engines.check.run_check`, what `gqakit eval X --engine vllm
  --check` runs, with its margins and rule): greedy tokens on `--check-prompts` WikiText-2
  windows (fixed token ids when ../shared is absent), scored teacher-forced by transformers on
  the same folder, the largest |vLLM logprob - transformers logprob| of the chosen tokens, and
  vLLM's allocated KV bytes per token vs gqakit's prediction;
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
from gqakit.core.units import parse_size
from gqakit.engines import EngineOptions, get_engine
from gqakit.engines.vllm import max_concurrency

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WIKI = SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw"
DTYPES = ("float32", "bfloat16", "float16")


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


def serving_check(path: Path, engine: Any, prompts: list[list[int]], tokens: int, dtype: str) -> dict[str, Any]:
    """gqakit's serving check of the loaded ENGINE against transformers on the same folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from gqakit.engines.check import run_check

    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    source = "WikiText-2 test" if WIKI.is_file() else "fixed ids"
    return run_check(path, engine, teacher, dtype=dtype, prompts=prompts, new_tokens=tokens,
                     prompt_source=source).model_dump()


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
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
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
    engines, models = {}, {}
    try:
        for name, path in paths.items():
            say(f"loading {name} ({path}) into vLLM")
            engines[name] = eng = get_engine("vllm")
            eng.load(path, options)
            prompts = check_prompts(path, args.check_prompts, args.check_length)
            say(f"serving check of {name}")
            check = serving_check(path, eng, prompts, args.check_tokens, args.dtype)
            kv = eng.kv_allocation()
            models[name] = {"model": str(path), "kv_bytes_per_token": kv.bytes_per_token,
                            "kv_bytes_predicted": check["kv"]["predicted_bytes_per_token"], "check": check,
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
    for m in models.values():
        m["throughput_tok_s"] = spread([args.requests * args.output / s for s in m["seconds"]])
        m["seconds_spread"] = spread(m["seconds"])
    result = {
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "load_average": os.getloadavg()},
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
