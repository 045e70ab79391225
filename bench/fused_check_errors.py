"""How far apart are the fused CPU decode step and the model's own step?

For one model, from --prompts random prompts (seeds 0..N-1, 2 sequences of 5 tokens), one
decode step both ways from the same prefilled cache, as `runtime/layers.check` does; prints
per prompt the logits' and the new cache entries' (worst layer) relative error
||got - ref|| / ||ref|| and largest element difference, the verdict of the check (relative,
1e-3) and what an element-wise rule (allclose, rtol 1e-4, atol 1e-4 for the cache
entries) would have said.

    .venv/bin/python -m bench.fused_check_errors /tmp/smol-g1 --prompts 10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not Path(args.model).exists():
        sys.exit(f"fused_check_errors: no such model: {args.model}")

    import torch

    from gqakit.core.loading import load_causal_lm
    from gqakit.runtime.layers import FusedDecode, both_steps, relative_error, verdict
    from gqakit.eval.speed import DecodeBench

    torch.set_num_threads(args.threads)
    bench = DecodeBench(load_causal_lm(args.model, dtype=torch.float32, device="cpu"), device="cpu", dtype=torch.float32)
    if bench.kernels is None:
        sys.exit("fused_check_errors: the CPU kernels are not built here")
    model, step = bench.model, FusedDecode(bench.model, bench.kernels)
    print("prompt | logits rel. error (max element diff) | cache entries rel. error (max element diff, layer) "
          "| check | element-wise check (allclose 1e-4)")
    for seed in range(args.prompts):
        r = both_steps(model, step, bench.new_cache, bench.vocab, bench.cache_kw, seed=seed)
        old_ok = torch.allclose(r.got, r.ref, rtol=1e-4, atol=1e-4 * max(1.0, r.ref.abs().max().item()))
        worst = (0.0, 0.0, -1)
        for i, (la, lb) in enumerate(zip(r.ref_cache.layers, r.got_cache.layers)):
            for name in ("keys", "values"):
                x, y = getattr(lb, name)[:, :, r.p], getattr(la, name)[:, :, r.p]
                e = relative_error(x, y)
                if e > worst[0]:
                    worst = (e, (x - y).abs().max().item(), i)
                old_ok = old_ok and torch.allclose(y, x, rtol=1e-4, atol=1e-4)
        print(f"{seed} | {relative_error(r.got, r.ref):.1e} ({(r.got - r.ref).abs().max().item():.1e}) | {worst[0]:.1e} "
              f"({worst[1]:.1e}, layer {worst[2]}) | {'pass' if verdict(r) is None else 'FAIL'} | "
              f"{'pass' if old_ok else 'FAIL'}", flush=True)


if __name__ == "__main__":
    main()
