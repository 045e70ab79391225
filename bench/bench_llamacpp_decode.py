"""llama.cpp's decode speed at depth D on an original GGUF and its gqakit conversion, through
gqakit's llama.cpp engine (`gqakit.engines.llamacpp`), against the prediction from bytes.

Converts SmolLM2-135M-Instruct Q4_1 (3 KV heads) to 1 KV head with
`gqakit convert SRC.gguf OUT.gguf -g 1 --method mean` (unless --converted is given), then, for
each model in alternating rounds, loads it in the engine and runs one llama-bench-style point:
`time_point(batch=1, prompt_len=D, new_tokens=N)` processes D prompt tokens in batches of 512
(prefill), then times N single-token decode steps over the filled cache. The KV bytes are
llama.cpp's own (`kv_allocation`: its state's K and V rows per token, F16 by default).

Prediction: a decode step reads every weight once (the GGUF's tensor bytes; with an untied LM
head the token embedding contributes one row) and the whole cache at depth D + N/2, so the
predicted speed-up is bytes(original) / bytes(converted). A point is memory-bound when its
achieved bytes per second are near the copy bandwidth of the same threads (measured each round).

    python -m bench.bench_llamacpp_decode --context 4096 --decode 64 --rounds 3 --threads 1

Needs gqakit[llamacpp]; writes bench/results/llamacpp_decode.json.
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

from bench.common import RESULTS, SMOLLM2, say

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def weight_bytes_per_step(path: Path) -> int:
    """Bytes of weights a decode step reads: every tensor, but of the token embedding only one
    row when an output matrix of its own is the LM head."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        emb = tensors["token_embd.weight"]
        total -= int(emb.n_bytes) - int(emb.n_bytes) // int(emb.shape[-1])
    return total


def model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def measure(path: Path, context: int, decode: int, threads: int) -> dict:
    from gqakit.engines import get_engine
    from gqakit.engines.base import EngineOptions

    engine = get_engine("llama.cpp")
    engine.load(path, EngineOptions(max_len=context + decode, threads=threads))
    kv = engine.kv_allocation()
    load0 = os.getloadavg()[0]
    t = engine.time_point(1, context, decode, reps=1, warmup=0)
    engine.close()
    steps = t.decode_s
    return {"prefill_tokens": context, "prefill_s": round(t.prefill_s[0], 3),
            "prefill_tok_per_s": round(context / t.prefill_s[0], 2), "decode_tokens": decode,
            "decode_s_total": round(sum(steps), 4), "decode_tok_per_s": round(decode / sum(steps), 2),
            "decode_step_ms_median": round(1000 * statistics.median(steps), 3),
            "kv_bytes_per_token": kv.bytes_per_token, "kv_predicted": kv.detail["predicted_bytes_per_token"],
            "kv_capacity_tokens": kv.capacity_tokens, "kv_total_bytes": kv.total_bytes,
            "kv_type": kv.detail["type_k"], "kv_heads": kv.detail["geometry"]["kv_heads"],
            "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=SMOLLM2)
    ap.add_argument("--converted", type=Path, default=None, help="an existing conversion (default: convert now)")
    ap.add_argument("--g", type=int, default=1)
    ap.add_argument("--method", default="mean")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads; on a loaded CPU, more threads than free cores make its "
                         "spinning thread pool far slower (measured here: 2.6 s per token with 2, 58 ms with 1)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-llamacpp-bench"))
    ap.add_argument("--out", type=Path, default=RESULTS / "llamacpp_decode.json")
    a = ap.parse_args()
    import llama_cpp
    import torch

    from gqakit.eval.speed.roofline import copy_bandwidth

    torch.set_num_threads(a.threads)
    converted = a.converted
    if converted is None:
        from gqakit.convert import convert_gguf

        converted = a.workdir / f"{a.source.stem}-g{a.g}-{a.method}.gguf"
        if not converted.is_file():
            t0 = time.perf_counter()
            convert_gguf(a.source, converted, a.g, a.method, progress=False)
            say(f"converted in {time.perf_counter() - t0:.1f} s: {converted}")
    models = {"original": a.source, "converted": converted}
    weights = {k: weight_bytes_per_step(p) for k, p in models.items()}
    runs: dict[str, list[dict]] = {k: [] for k in models}
    bandwidth = []
    for r in range(a.rounds):  # alternating, so machine drift hits both alike
        bandwidth.append(copy_bandwidth("cpu") / 1e9)
        for name, path in models.items():
            m = measure(path, a.context, a.decode, a.threads)
            depth = a.context + a.decode / 2
            m["bytes_per_step"] = int(weights[name] + depth * m["kv_bytes_per_token"])
            m["achieved_gbs"] = round(m["bytes_per_step"] * m["decode_tok_per_s"] / 1e9, 3)
            runs[name].append(m)
            say(f"round {r + 1} {name:9s} kv_heads {m['kv_heads']} decode {m['decode_tok_per_s']} tok/s, prefill "
                f"{m['prefill_tok_per_s']} tok/s, {m['achieved_gbs']} GB/s (copy {bandwidth[-1]:.1f} GB/s), "
                f"load {m['loadavg_1min']}")
    o, c = runs["original"][0], runs["converted"][0]
    predicted = o["bytes_per_step"] / c["bytes_per_step"]
    ratios = [y["decode_tok_per_s"] / x["decode_tok_per_s"] for x, y in zip(runs["original"], runs["converted"])]
    result = {"source": a.source.name, "converted": converted.name, "g": a.g, "method": a.method,
              "context": a.context, "decode": a.decode, "threads": a.threads, "rounds": a.rounds,
              "llama_cpp_python": llama_cpp.__version__, "cpu": model_name(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d"),
              "weight_bytes_per_step": weights, "copy_bandwidth_gbs": [round(b, 2) for b in bandwidth],
              "median_decode_tok_per_s": {k: statistics.median(x["decode_tok_per_s"] for x in v)
                                          for k, v in runs.items()},
              "speedup_per_round": [round(x, 3) for x in ratios], "speedup_median": round(statistics.median(ratios), 3),
              "speedup_predicted": round(predicted, 3),
              "of_prediction": round(statistics.median(ratios) / predicted, 3), "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"| model | KV heads | KV cache (F16, {o['kv_capacity_tokens']} cells) | decode tok/s per round | "
          f"prefill tok/s |\n|---|---|---|---|---|\n"
          f"| {a.source.name} | {o['kv_heads']} | {o['kv_total_bytes'] / 2**20:.1f} MiB | "
          f"{', '.join(str(x['decode_tok_per_s']) for x in runs['original'])} | "
          f"{statistics.median(x['prefill_tok_per_s'] for x in runs['original']):.1f} |\n"
          f"| {converted.name} | {c['kv_heads']} | {c['kv_total_bytes'] / 2**20:.1f} MiB | "
          f"{', '.join(str(x['decode_tok_per_s']) for x in runs['converted'])} | "
          f"{statistics.median(x['prefill_tok_per_s'] for x in runs['converted']):.1f} |\n"
          f"\nspeed-up per round {result['speedup_per_round']}, median {result['speedup_median']}x; predicted "
          f"{result['speedup_predicted']}x from bytes; {100 * result['of_prediction']:.0f}% of the prediction",
          file=sys.stdout)


if __name__ == "__main__":
    main()
