"""gqakit's CPU decode kernels against what they replace, on one model's shapes (fp32).

Weights: every linear of a decode step (by default SmolLM2-135M's 211 matrices, 538 MB: more
than the last-level cache, so each call streams from memory), multiplied at 1, 4 and 8 rows
by ATen's `linear`, oneDNN's once-packed weight, and gqakit's panel kernel; GB/s of weights.
Attention: one decode step's attention over every layer's cache (batch x positions, the
tail past --filled masked, as in a static cache), grouped matmuls (`decode_attention`)
against the fused kernel, for each KV-head count given; GB/s of filled K/V.
Random normal values (never zeros). Medians of --reps.

    .venv/bin/python -m bench.bench_cpu_kernels --threads 2 --out bench/results/cpu_kernels.json

`--against FILE` also builds another version of the kernels' source (for example
`git show REV:runtime/cpu_kernels.cpp > /tmp/old.cpp`) and times its fused attention against
the current one's, the two alternating call by call so that a noisy machine slows both
alike (`--rows ""` skips the weights part):

    .venv/bin/python -m bench.bench_cpu_kernels --threads 2 --rows "" --against /tmp/old.cpp --reps 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def timed_pair(fns: dict, reps: int) -> dict:
    """Median seconds of each of `fns`, their calls alternating one by one after a warm-up."""
    for fn in fns.values():
        fn()
    ts: dict = {n: [] for n in fns}
    for _ in range(reps):
        for n, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in ts.items()}


def build_other(path: str):
    """Another version of the kernels' source, built under its own name and folder."""
    import hashlib
    from pathlib import Path

    from torch.utils.cpp_extension import load

    from gqakit.runtime import kernels as cpu_kernels

    src = Path(path).read_bytes()
    d = cpu_kernels.build_dir().parent / ("against-" + hashlib.sha256(src).hexdigest()[:16])
    d.mkdir(parents=True, exist_ok=True)
    copy = d / "against_kernels.cpp"
    copy.write_bytes(src)
    return load("gqakit_against_kernels", [str(copy)], build_directory=str(d),
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--mlp", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", default="3,1")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--positions", type=int, default=1056)
    ap.add_argument("--filled", type=int, default=1030)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--against", default=None, metavar="FILE",
                    help="another version of cpu_kernels.cpp whose panel GEMM and fused attention are timed against this one's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from gqakit.runtime import kernels as cpu_kernels
    from gqakit.runtime.grouped import decode_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    k = cpu_kernels.load()
    if k is None:
        raise SystemExit(f"bench_cpu_kernels: the kernels did not build: {cpu_kernels.why_unavailable()}")
    torch.manual_seed(0)
    h, m, d, kvh = args.hidden, args.mlp, args.head_dim, max(int(x) for x in args.kv_heads.split(","))
    shapes = []
    for _ in range(args.layers):
        shapes += [(args.heads * d, h), (kvh * d, h), (kvh * d, h), (h, args.heads * d), (m, h), (m, h), (h, m)]
    shapes.append((args.vocab, h))
    ws = [torch.randn(s) * 0.02 for s in shapes]
    nbytes = sum(w.numel() * 4 for w in ws)
    panels = [k.pack_weight(w) for w in ws]
    out = {"device": "cpu", "dtype": "float32", "threads": torch.get_num_threads(), "weight_bytes": nbytes,
           "args": vars(args), "linear": [], "attention": []}
    print(f"{len(ws)} weight matrices, {nbytes / 1e6:.0f} MB, fp32, {torch.get_num_threads()} threads")
    other = build_other(args.against) if args.against else None
    for rows in (int(x) for x in args.rows.split(",") if x.strip()):
        xs = {n: torch.randn(rows, n) for n in {s[1] for s in shapes}}
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
        paths = {
            "aten": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws],
            "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                               for w, p in zip(ws, onednn)],
            "panels": lambda: [k.skinny_linear(xs[w.shape[1]], p, w.shape[0], None) for w, p in zip(ws, panels)],
        }
        row = {"rows": rows}
        for name, fn in paths.items():
            t = timed(fn, args.reps)
            row[name] = {"ms": 1e3 * t, "gb_s": nbytes / t / 1e9}
        out["linear"].append(row)
        print(f"rows {rows}: " + ", ".join(f"{n} {row[n]['gb_s']:.1f} GB/s" for n in paths))
        del onednn
        if other is not None:
            theirs = [other.pack_weight(w) for w in ws]
            torch.testing.assert_close(other.skinny_linear(xs[h], theirs[0], ws[0].shape[0], None),
                                       k.skinny_linear(xs[h], panels[0], ws[0].shape[0], None), rtol=1e-5, atol=1e-5)
            pair = timed_pair({n: (lambda mod=mod, pp=pp: [mod.skinny_linear(xs[w.shape[1]], p, w.shape[0], None)
                                                           for w, p in zip(ws, pp)])
                               for n, mod, pp in (("this", k, panels), ("against", other, theirs))}, args.reps)
            row["alternating"] = {n: {"ms": 1e3 * tm, "gb_s": nbytes / tm / 1e9} for n, tm in pair.items()}
            print(f"  alternating with --against: panels this {nbytes / pair['this'] / 1e9:.1f} GB/s, against "
                  f"{nbytes / pair['against'] / 1e9:.1f} GB/s ({pair['against'] / pair['this']:.2f}x)")
            del theirs
    b, t, f = args.batch, args.positions, args.filled
    for g in (int(x) for x in args.kv_heads.split(",")):
        qs = [torch.randn(b, args.heads, 1, d) for _ in range(args.layers)]
        ks = [torch.randn(b, g, t, d) for _ in range(args.layers)]
        vs = [torch.randn(b, g, t, d) for _ in range(args.layers)]
        mask = torch.zeros(b, 1, 1, t)
        mask[..., f:] = float("-inf")
        kv = 2 * b * g * f * d * 4 * args.layers
        row = {"kv_heads": g, "kv_bytes": kv}
        for name, fused in (("matmul", False), ("fused", True)):
            tm = timed(lambda: [decode_attention(q, kk, v, mask, d ** -0.5, fused=fused)
                                for q, kk, v in zip(qs, ks, vs)], args.reps)
            row[name] = {"ms": 1e3 * tm, "gb_s": kv / tm / 1e9}
        print(f"attention, {g} KV heads ({kv / 1e6:.0f} MB): matmul {row['matmul']['ms']:.1f} ms "
              f"({row['matmul']['gb_s']:.1f} GB/s), fused {row['fused']['ms']:.1f} ms ({row['fused']['gb_s']:.1f} GB/s)")
        if other is not None:
            flat = mask.reshape(b, t).contiguous()
            for q, kk, v in zip(qs[:2], ks, vs):  # the same results first
                torch.testing.assert_close(other.decode_attention(q, kk, v, flat, d ** -0.5),
                                           k.decode_attention(q, kk, v, flat, d ** -0.5), rtol=1e-5, atol=1e-5)
            pair = timed_pair({n: (lambda mod=mod: [mod.decode_attention(q, kk, v, flat, d ** -0.5)
                                                    for q, kk, v in zip(qs, ks, vs)])
                               for n, mod in (("this", k), ("against", other))}, args.reps)
            row["alternating"] = {n: {"ms": 1e3 * tm, "gb_s": kv / tm / 1e9} for n, tm in pair.items()}
            print(f"  alternating with --against: this {1e3 * pair['this']:.1f} ms, against "
                  f"{1e3 * pair['against']:.1f} ms ({pair['against'] / pair['this']:.2f}x)")
        out["attention"].append(row)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
