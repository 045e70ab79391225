"""An encoder-decoder's grid point (eval/speed/seq2seq.py): its typed state while open, and
`summarize`, its measurements against the device's roof once closed."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from gqakit.eval.records import SpeedPoint
from gqakit.eval.speed.point import OpenPoint, timings

CACHES = "transformers.EncoderDecoderCache of two StaticCaches (self-attention, cross-attention; pre-allocated)"


@dataclass
class Seq2SeqPoint(OpenPoint):
    """An open encoder-decoder grid point: `prompt_len` is the input length."""

    output_len: int = 1
    encoded: Any = None        # the encoder's output, made once per point
    encode_s: float = 0.0      # the encoder's time
    first_s: float = 0.0       # encoder + decoder prefix: the time to the first token

    @property
    def axes(self) -> dict[str, int]:
        return {"batch": self.batch, "prompt_len": self.prompt_len, "output_len": self.output_len,
                "new_tokens": self.new_tokens}


def summarize(bench: Any, pt: Seq2SeqPoint, roof: dict[str, float], *, peak: int | None) -> SpeedPoint:
    """The measurements of a closed point against the device's `roof`: the bytes a step must
    read are the decoder's weights, the self-attention cache at the output position (mean
    over the steps) and the whole cross-attention cache."""
    batch, input_len, dec = pt.batch, bench.input.positions(pt.prompt_len), pt.dec  # cross-attention positions
    step = statistics.median(dec)
    mean_out = pt.output_len + (pt.new_tokens + 1) / 2
    self_kv = batch * bench.kv_bytes_per_token * mean_out
    cross_kv = batch * bench.kv_bytes_per_input_token * input_len
    total = bench.weight_bytes + self_kv + cross_kv
    flops = 2 * bench.matmul_params * batch + 4 * batch * bench.layers * bench.heads * bench.head_dim * (mean_out + input_len)
    t_bytes = total / roof["copy_bandwidth"]
    t_flops = flops / roof["matmul_flops"] if roof.get("matmul_flops") else None
    weights = ("as loaded" if not pt.packed_bytes else "packed once (oneDNN)" if bench.kernels is None
               else "packed once (gqakit panels, one huge-page buffer in the step's order)" if bench.lean is not None
               else "packed once (gqakit panels)")
    first = {"median": 1e3 * pt.first_s, "p90": 1e3 * pt.first_s}
    return SpeedPoint(
        **pt.axes, status="ok", decode_mode=bench.decode_mode,
        decode_path={"steps": bench.decode_mode, "weights": weights, "attention": bench.attn_impl, "layers": bench.layers_mode,
                     "caches": CACHES, "prefill": "once per point (encoder, then the decoder prefix); decode "
                                                  "repetitions rewind the self-attention cache"},
        decode_samples=len(dec), decode_sample="one step" if len(dec) > pt.reps else "mean step of a repetition",
        prefill_ms=first, prefill_samples=1, encode_ms={"median": 1e3 * pt.encode_s, "p90": 1e3 * pt.encode_s},
        **timings(batch, [], dec),
        warmup_s=pt.warmup_s, compile_s=None, reps=pt.reps, packed_weight_bytes=pt.packed_bytes,
        peak_memory_bytes=peak,
        peak_memory_kind="cuda max_memory_allocated" if bench.device.type == "cuda" else "process peak RSS",
        kv_cache_bytes=pt.kv_bytes,
        kv_cache_bytes_analytic=batch * (input_len * bench.kv_bytes_per_input_token
                                         + (pt.output_len + pt.new_tokens) * bench.kv_bytes_per_token),
        bytes_per_step={"weights": bench.weight_bytes, "kv": self_kv + cross_kv, "self_attention_kv": self_kv,
                        "cross_attention_kv": cross_kv, "total": total},
        flops_per_step=flops,
        roofline_ms={"bytes": 1e3 * t_bytes, "flops": None if t_flops is None else 1e3 * t_flops},
        achieved_bandwidth_gbs=total / step / 1e9,
        roofline_fraction=total / step / roof["copy_bandwidth"],
        arithmetic_intensity=flops / total,
        memory_bound=flops / total < roof["ridge_flops_per_byte"],
    )
