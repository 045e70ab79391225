"""The arithmetic of bench/bench_llamacpp_decode.py's sweep, apart from llama.cpp: the bytes a
decode step reads, the attention arithmetic per cached byte, each point's classification
(memory-bound or not) and its ratios against the prediction, the random MHA source, the table.

A decode step reads every weight once and the whole KV cache. Step i (0-based) of N after a
prefill of D tokens writes position D + i and attends over D + i + 1 cached positions, so the
mean depth of the N timed steps is D + (N + 1) / 2. Its attention does 2 x heads x head_dim
multiply-adds per cached position and layer (scores, then the weighted sum of V) and reads
2 x kv_heads x head_dim cache elements there: heads / (kv_heads x bytes per element)
multiply-adds per cached byte, 0.5 for an F16 MHA cache, 1.5 for 9 query heads on 3 KV heads.
A point is memory-bound when the original's step reaches THRESHOLD of the copy bandwidth
measured beside it with the same threads; there the speed-up can follow the bytes.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

LLAMA_VOCAB = 32000  # Llama-2's vocabulary size
F16_BYTES = 2


def parse_mha(text: str, vocab: int = LLAMA_VOCAB) -> dict[str, int]:
    """LAYERSxHIDDENxHEADS (e.g. 12x768x12) -> the shape of a Llama MHA model: head_dim
    HIDDEN / HEADS, Llama's MLP width (8/3 x HIDDEN rounded up to a multiple of 256), VOCAB."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*", text.lower())
    if not m:
        raise ValueError(f"--random-mha {text!r}: give LAYERSxHIDDENxHEADS, e.g. 12x768x12")
    layers, hidden, heads = (int(x) for x in m.groups())
    if min(layers, hidden, heads) < 1 or hidden % heads or (hidden // heads) % 2:
        raise ValueError(f"--random-mha {text!r}: HIDDEN must be HEADS times an even head size")
    return {"layers": layers, "hidden": hidden, "heads": heads, "head_dim": hidden // heads,
            "intermediate": 256 * math.ceil(8 * hidden / 3 / 256), "vocab": vocab}


def mha_name(shape: dict[str, int], seed: int) -> str:
    return f"random-mha-{shape['layers']}x{shape['hidden']}x{shape['heads']}-seed{seed}.F16"


def write_random_mha(path: Path, shape: dict[str, int], seed: int = 0) -> Path:
    """A random-weight Llama-architecture F16 GGUF of SHAPE with as many KV heads as heads
    (weights N(0, 0.02), norms near 1: never zeros; a plain SentencePiece-style vocabulary of
    VOCAB tokens), written by bench_gguf_stream's writer with the `gguf` package."""
    from bench.bench_gguf_stream import write_llama_gguf

    write_llama_gguf(path, shape, shape["layers"], "F16", seed=seed)
    return path


def mean_depth(context: int, decode: int) -> float:
    """Mean number of cached positions a timed step attends over (see the module's text)."""
    return context + (decode + 1) / 2


def step_bytes(weight_bytes: int, kv_bytes_per_token: int, context: int, decode: int) -> int:
    """Bytes one decode step reads on average: every weight once and the cache at the mean depth."""
    return int(weight_bytes + mean_depth(context, decode) * kv_bytes_per_token)


def macs_per_cache_byte(heads: int, kv_heads: int, bytes_per_element: float = F16_BYTES) -> float:
    """Attention multiply-adds per byte of KV cache read, per decode step."""
    return heads / (kv_heads * bytes_per_element)


def summarize_point(models: dict[str, dict], copy_gbs: list[float], threshold: float,
                    original: str = "original") -> dict:
    """One point (a source at one depth and thread count) from its rounds. MODELS: name ->
    {"tok_per_s": [one per round], "bytes_per_step": int, ...}, the original under ORIGINAL;
    COPY_GBS: the copy bandwidth measured in each round, beside the models. Per model: GB/s per
    round, its fraction of that round's copy bandwidth and the median; per converted model the
    predicted ratio (bytes of the original's step / its own), the tokens/s ratio per round and
    its median, and that median as a fraction of the prediction. The point is memory-bound when
    the original's median fraction of copy bandwidth is at least THRESHOLD."""
    if not copy_gbs or any(len(m["tok_per_s"]) != len(copy_gbs) for m in models.values()):
        raise ValueError("every model needs one speed per round, and every round a copy bandwidth")
    base = models[original]
    out: dict[str, dict] = {}
    for name, m in models.items():
        gbs = [m["bytes_per_step"] * s / 1e9 for s in m["tok_per_s"]]
        of_copy = [g / c for g, c in zip(gbs, copy_gbs)]
        row = {**m, "tok_per_s_median": statistics.median(m["tok_per_s"]), "gbs_per_round": gbs,
               "gbs_median": statistics.median(gbs), "of_copy_per_round": of_copy,
               "of_copy": statistics.median(of_copy)}
        if name != original:
            ratios = [s / b for s, b in zip(m["tok_per_s"], base["tok_per_s"])]
            predicted = base["bytes_per_step"] / m["bytes_per_step"]
            row |= {"predicted_ratio": predicted, "ratio_per_round": ratios, "ratio": statistics.median(ratios),
                    "of_prediction": statistics.median(ratios) / predicted}
        out[name] = row
    bound = out[original]["of_copy"] >= threshold
    return {"copy_gbs_per_round": list(copy_gbs), "copy_gbs_median": statistics.median(copy_gbs),
            "threshold": threshold, "memory_bound": bound, "models": out}


def markdown_table(points: list[dict]) -> str:
    """One row per model and point: what docs/benchmarks.md's table shows."""
    head = ("| source | model | KV heads | threads | depth | tok/s per round | median | GB/s (of copy) | "
            "copy GB/s | memory-bound | ratio | predicted | of prediction |\n|" + "---|" * 13)
    rows = [head]
    for p in points:
        for name, m in p["models"].items():
            pred = (f"{m['ratio']:.2f}x | {m['predicted_ratio']:.2f}x | {100 * m['of_prediction']:.0f}%"
                    if "ratio" in m else " | | ")
            rows.append(f"| {p['source']} | {name} | {m['kv_heads']} | {p['threads']} | {p['depth']} | "
                        f"{', '.join(f'{s:.1f}' for s in m['tok_per_s'])} | {m['tok_per_s_median']:.1f} | "
                        f"{m['gbs_median']:.2f} ({100 * m['of_copy']:.0f}%) | {p['copy_gbs_median']:.1f} | "
                        f"{'yes' if p['memory_bound'] else 'no'} | {pred} |")
    return "\n".join(rows)
