"""Decode speed of a T5-base-shaped encoder-decoder, multi-head against gqakit's grouped T5:
the measured speedup against the one the bytes predict.

Builds, with random weights in fp32 (no download; speed depends on shapes, not values), T5
1.1's base shape: d_model 768, 12 heads of 64, gated-GELU MLP 2048, 12 encoder and 12
decoder layers, vocab 32128. Once with 12 KV heads (stock `T5ForConditionalGeneration`),
and once per `--kv-heads` G with gqakit's `GqakitT5ForConditionalGeneration`: the decoder's
self- and cross-attention grouped, the encoder multi-head, as in the GQA paper. At each grid
point (batch x input length x output length) every model's encoder runs once and its decoder
prefix fills both caches (`gqakit.eval.speed.Seq2SeqBench`); then the models' timed decode
steps alternate one by one (`gqakit.eval.speed.run_points_alternating`), so load from other
processes hits all alike, and the roofs are measured between repetitions.

Each grouped model gets, per point: the measured speedup (ratio of median step times), the
speedup predicted by bytes (decoder weights + self-attention cache + cross-attention cache,
2 x 12 layers x G x 64 x input length x 4 bytes per sequence; `eval.speed.predict_speedup`),
and the share of the predicted gain achieved, (measured - 1) / (predicted - 1).

    .venv/bin/python -m bench.bench_decode_seq2seq --threads 2     # batch 1,8 x input 512,4096, G = 4 and 1
    .venv/bin/python -m bench.bench_decode_seq2seq --shape tiny --input-len 32 --out /tmp/s2s.jsonl   # seconds

Appends one JSON line per model and point to `--out` (default bench/results/decode_seq2seq.jsonl)
as soon as the point is measured, with the machine's load average at its start and end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import RESULTS, append_jsonl, say  # noqa: E402

# T5 1.1 base (google/t5-v1_1-base): the shape of the measurement; `tiny` checks the script.
SHAPES = {
    "t5-base": dict(d_model=768, num_heads=12, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12,
                    vocab_size=32128),
    "tiny": dict(d_model=64, num_heads=4, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, vocab_size=512),
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="t5-base")
    ap.add_argument("--kv-heads", default="4,1", help="KV heads of the grouped models (divisors of the heads)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--input-len", default="512,4096")
    ap.add_argument("--output-len", default="1")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--eager", action="store_true",
                    help="the model's own step: weights as loaded, transformers' attention as it dispatches")
    ap.add_argument("--out", default=str(RESULTS / "decode_seq2seq.jsonl"))
    return ap


def build(shape: dict[str, Any], kv_heads: int | None, device: str) -> Any:
    """The shape with transformers' random initialisation: stock T5 (kv_heads None) or gqakit's grouped T5."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from gqakit.convert.remote.gqakit_modeling_t5 import GqakitT5Config, GqakitT5ForConditionalGeneration

    common = dict(**shape, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device(device):
        if kv_heads is None:
            model = T5ForConditionalGeneration(T5Config(**common))
        else:
            model = GqakitT5ForConditionalGeneration(GqakitT5Config(**common, num_key_value_heads=kv_heads))
    return model.eval()


def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Measured against predicted speedup of `other` over `base` at one point (both status ok)."""
    from gqakit.eval.speed import StepCost, predict_speedup, share

    measured = base["decode_ms_per_token"]["median"] / other["decode_ms_per_token"]["median"]
    pred = predict_speedup(StepCost.of(base), StepCost.of(other))
    return {"measured_speedup": measured, "predicted_speedup_bytes": pred.bytes,
            "share_of_predicted": share(measured, pred.bytes), "predicted_speedup_roofline": pred.roofline,
            "compute_bound": pred.compute_bound, "fraction_of_predicted": measured / pred.bytes}


def main() -> None:
    args = parser().parse_args()
    out = Path(args.out)
    if out.exists() and not out.is_file():
        sys.exit(f"bench_decode_seq2seq: {out} is not a file")

    import torch

    from gqakit.eval.provenance import run_info
    from gqakit.eval.speed import Seq2SeqBench, parse_ints, run_points_alternating

    if args.threads:
        torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    groups = parse_ints(args.kv_heads, "--kv-heads")
    if any(shape["num_heads"] % g or g >= shape["num_heads"] for g in groups):
        sys.exit(f"bench_decode_seq2seq: --kv-heads must be divisors of {shape['num_heads']} below it")
    batches, inputs, outputs = (parse_ints(getattr(args, k), f"--{k.replace('_', '-')}")
                                for k in ("batch", "input_len", "output_len"))
    dtype = torch.float32
    names = ["mha"] + [f"g{g}" for g in groups]
    benches = {}
    for name, g in zip(names, [None, *groups]):
        say(f"building {args.shape} {name}")
        benches[name] = Seq2SeqBench(build(shape, g, args.device), device=args.device, dtype=dtype,
                                     pack_weights=not args.eager, fold_attention=not args.eager)
    run = run_info(command=["python", "-m", "bench.bench_decode_seq2seq", *sys.argv[1:]], device=args.device,
                   dtype=dtype).to_json()
    probes = {n: b.probe() for n, b in benches.items()}
    for o in outputs:
        for i in inputs:
            for b in batches:
                load_start = os.getloadavg()
                t0 = time.time()
                points, roof = run_points_alternating(benches, b, i, args.new_tokens, args.reps, args.warmup,
                                                      output_len=o)
                rows = {n: {"model": n, "shape": args.shape, "kv_heads": benches[n].kv_heads, **p.to_json()}
                        for n, p in points.items()}
                for n, row in rows.items():
                    row.update(roof={"copy_bandwidth_gbs": roof["copy_bandwidth"] / 1e9,
                                     "matmul_gflops": roof["matmul_flops"] / 1e9,
                                     "ridge_flops_per_byte": roof["ridge_flops_per_byte"]},
                               attention=probes[n]["decode_path"], threads=torch.get_num_threads(),
                               loadavg_start=load_start, loadavg_end=os.getloadavg(), cores=os.cpu_count(),
                               point_s=time.time() - t0, run=run)
                    if n != "mha" and row["status"] == "ok" and rows["mha"]["status"] == "ok":
                        row["comparison"] = compare(rows["mha"], row)
                    append_jsonl(out, row)
                    c = row.get("comparison")
                    say(f"b{b} in{i} out{o} {n}: {row['status']}"
                        + (f" {row['decode_ms_per_token']['median']:.2f} ms/step" if row["status"] == "ok" else "")
                        + (f", speedup {c['measured_speedup']:.2f}x of predicted {c['predicted_speedup_bytes']:.2f}x"
                           f" ({100 * c['fraction_of_predicted']:.0f}%)" if c else "")
                        + f", load {load_start[0]:.1f}")


if __name__ == "__main__":
    main()
