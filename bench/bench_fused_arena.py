"""One buffer for all of a model's packed weights, or one per matrix?

The fused CPU decode step (`runtime/layers.py`) streams every weight matrix once per
step. Packed into one 2 MiB-aligned buffer advised as huge pages ("arena", the default),
the stream has no gaps and matrices under 2 MiB (a 1-KV-head model's stacked q/k/v, every
o-proj of SmolLM2) sit on huge pages too; packed one buffer per matrix ("separate"), those small ones are on 4 KiB pages. This builds both for one model and
times their steps alternating one by one on the same cache, at each batch x prompt point.

    G=~/.cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    .venv/bin/python -m bench.bench_fused_arena $G /tmp/smol-g1 --batch 1,8 --prompt-len 256,1024

Appends one JSON line per model to --out (default bench/results/fused_arena.jsonl).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench.common import RESULTS, append_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt-len", default="256,1024")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per variant and point (after 4 warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "fused_arena.jsonl"))
    args = ap.parse_args()
    for m in args.models:
        if not Path(m).exists():
            sys.exit(f"bench_fused_arena: no such model: {m}")
        if Path(args.out).resolve() == Path(m).resolve() or Path(m).resolve() in Path(args.out).resolve().parents:
            sys.exit(f"bench_fused_arena: --out {args.out} is a model or inside one")

    import torch

    from gqakit.core.loading import load_causal_lm
    from gqakit.runtime.layers import FusedDecode, check
    from gqakit.eval.provenance import run_info
    from gqakit.eval.speed import DecodeBench, copy_bandwidth, parse_ints

    torch.set_num_threads(args.threads)
    batches, lens = parse_ints(args.batch, "--batch"), parse_ints(args.prompt_len, "--prompt-len")
    for path in args.models:
        bench = DecodeBench(load_causal_lm(path, dtype=torch.float32, device="cpu"), device="cpu", dtype=torch.float32)
        if bench.kernels is None:
            sys.exit("bench_fused_arena: the CPU kernels are not built here")
        steps = {"arena": FusedDecode(bench.model, bench.kernels, arena=True),
                 "separate": FusedDecode(bench.model, bench.kernels, arena=False)}
        for name, step in steps.items():
            why = check(bench.model, step, bench.new_cache, bench.vocab, bench.cache_kw)
            if why:
                sys.exit(f"bench_fused_arena: {name}: {why}")
        rows = []
        for p in lens:
            for b in batches:
                times: dict[str, list[float]] = {k: [] for k in steps}
                with torch.inference_mode():
                    cache = bench.new_cache(b, p + 8)
                    bench.model(input_ids=torch.randint(0, bench.vocab, (b, p)), **{bench.cache_kw: cache},
                                position_ids=torch.arange(p).unsqueeze(0), use_cache=True)
                    tok, pos = torch.randint(0, bench.vocab, (b, 1)), torch.full((1, 1), p)
                    for i in range(args.steps + 4):
                        for k in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
                            for layer in cache.layers:  # the same slot every step: same bytes, same work
                                layer.cumulative_length.fill_(p)
                            t = time.perf_counter()
                            steps[k](input_ids=tok, past_key_values=cache, position_ids=pos)
                            if i >= 4:
                                times[k].append(time.perf_counter() - t)
                ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
                rows.append({"batch": b, "prompt_len": p, "ms_per_step": ms, "separate_over_arena": ms["separate"] / ms["arena"],
                             "copy_bandwidth_gbs": copy_bandwidth("cpu") / 1e9})
                print(f"{Path(path).name} b{b} p{p}: arena {ms['arena']:.2f} ms, separate {ms['separate']:.2f} ms "
                      f"({ms['separate'] / ms['arena']:.2f}x)", flush=True)
        rec = {"argv": sys.argv, "model": path, "threads": args.threads, "steps": args.steps, "rows": rows,
               "loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               "run": run_info(command=sys.argv, device="cpu", dtype=torch.float32).to_json()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(args.out, rec)


if __name__ == "__main__":
    main()
