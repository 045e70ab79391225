"""torch.profiler table of a few decode steps of a real model (what docs/decode.md rests on).

The static cache is filled with random keys and values up to --prompt-len (no prefill:
a decode step's work does not depend on what the cache holds), then --steps decode steps
run under the profiler. `--eager` profiles the plain transformers step (loaded weights,
SDPA attention); the default is gqakit's fast path (packed weights from batch 2, grouped
matmul decode attention).

    .venv/bin/python -m bench.profile_decode ~/.cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --batch 8 --prompt-len 1024 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _Labelled:
    """A kernel module whose calls show in the profile as `gqakit::<name>`."""

    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name):
        import torch

        fn = getattr(self._mod, name)

        def call(*args):
            with torch.profiler.record_function(f"gqakit::{name}"):
                return fn(*args)

        return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--compile", action="store_true", help="the compiled step (CPU: weights frozen), compiled in the warm-up")
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from gqakit.core.loading import load_causal_lm
    from gqakit.runtime.packed import packed_linears
    from gqakit.eval.speed import DecodeBench

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_causal_lm(args.model, dtype=torch.float32, device="cpu")
    bench = DecodeBench(model, device="cpu", dtype=torch.float32, pack_weights=not args.eager,
                        decode_kernel="sdpa" if args.eager else "matmul", compile=args.compile)
    b, p = args.batch, args.prompt_len
    labels = contextlib.ExitStack()
    if bench.kernels is not None:
        # the compiled kernels are pybind functions, which the profiler does not see: label each call
        from gqakit.runtime import kernels as cpu_kernels

        bench.kernels = labels.enter_context(cpu_kernels.substituted(_Labelled(bench.kernels)))
    pack = (packed_linears(model, b, kernels=bench.kernels) if bench.pack_weights and (b > 1 or bench.kernels is not None)
            else contextlib.nullcontext())
    with labels, torch.inference_mode(), pack:
        cache = bench.new_cache(b, p + args.steps + 2)
        for layer in cache.layers:
            layer.keys.normal_()
            layer.values.normal_()
        bench.rewind(cache, p)
        tok = torch.zeros((b, 1), dtype=torch.long)
        bench.decode(cache, tok, p, 2)  # warm-up
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.perf_counter()
            bench.decode(cache, tok, p + 2, args.steps)
            step = (time.perf_counter() - t0) / args.steps
    print(f"{args.model}: {bench.kv_heads}/{bench.heads} KV/query heads, batch {b}, prompt {p}, "
          f"{torch.get_num_threads()} threads, {'eager' if args.eager else bench.decode_mode}: "
          f"{1e3 * step:.1f} ms/step under the profiler")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
