"""llama.cpp's decode speed of original GGUFs and their gqakit conversions, swept over thread
counts and depths, each point classified as memory-bound or not and its tokens/s ratio set
against the prediction from bytes.

Sources: a GGUF (--source; SmolLM2-135M-Instruct Q4_1 by default, 9 query heads on 3 KV heads,
--no-source to leave it out) and, with --random-mha LAYERSxHIDDENxHEADS, a random-weight
Llama-architecture F16 GGUF with one query head per KV head (vocabulary 32,000, head_dim
HIDDEN / HEADS), the kind of checkpoint gqakit converts. Each source is converted to every
--g with `gqakit convert SRC.gguf OUT.gguf -g G --method mean -q` (a G the source refuses is
recorded as skipped, with gqakit's one-line reason).

For each source and depth D (--context), every model is loaded in gqakit's llama.cpp engine
(`gqakit.engines.llamacpp`, F16 cache, flash attention as the engine sets it, recorded per model
as `flash_attn`) and its cache filled once with D prompt tokens (the ids `time_point` uses, in
batches of 512, on --prefill-threads threads). Then, for each thread count, in rounds that
alternate the models (drift hits all alike): the copy bandwidth of that many threads (torch, 256
MiB), then per model N = --decode single-token steps timed as `time_point` times them
(llama.cpp's decode of one token, then the argmax of its logits), after 2 untimed steps and a
rewind of the cache to D (llama-cpp-python's eval drops the cells from `n_tokens` on), so every
round decodes at depths D+1 .. D+N.

Bytes per step: the GGUF's tensors (of the token embedding one row when the LM head is a
matrix of its own) plus the cache at the mean depth, with llama.cpp's own bytes per cached
token (`kv_allocation`). A point is memory-bound when the original's GB/s reach --memory-bound
(0.8) of the copy bandwidth; bench/llamacpp_sweep.py holds this arithmetic.

    python -m bench.bench_llamacpp_decode --random-mha 12x768x12 --g 4 1 --threads 1 2 \\
        --context 4096 --decode 64 --rounds 3

Needs gqakit[llamacpp]; writes bench/results/llamacpp_decode_sweep.json (after every point,
"complete": false until the last) and prints the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, SMOLLM2, say, write_json
from bench.llamacpp_sweep import (macs_per_cache_byte, markdown_table, mha_name, parse_mha, step_bytes,
                                  summarize_point, write_random_mha)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def weight_bytes_per_step(path: Path) -> int:
    """Bytes of weights a decode step reads, in the GGUF's own types (the engine's count)."""
    from gqakit.engines.llamacpp_kv import gguf_step_weight_bytes

    return gguf_step_weight_bytes(path)


def model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def convert(src: Path, g: int, method: str, workdir: Path) -> tuple[Path | None, str | None]:
    """SRC converted to G KV heads by the `gqakit convert` command (an earlier output in WORKDIR
    is reused): its path, or None and gqakit's one-line reason."""
    out = workdir / f"{src.stem}-g{g}-{method}.gguf"
    if out.is_file():
        return out, None
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "gqakit", "convert", str(src), str(out), "-g", str(g),
                        "--method", method, "-q"], capture_output=True, text=True)
    if r.returncode:
        return None, (r.stderr.strip().splitlines() or [f"gqakit convert exited {r.returncode}"])[-1]
    say(f"converted {src.name} to G={g} in {time.perf_counter() - t0:.1f} s: {out}")
    return out, None


def prompt_ids(n: int, n_vocab: int) -> list[int]:
    return [(7 + 7919 * i) % n_vocab for i in range(n)]  # the engine's time_point ids: speed reads no text


def load_and_fill(path: Path, depth: int, decode: int, threads: int) -> tuple[object, dict]:
    """PATH loaded in the llama.cpp engine with room for DEPTH + DECODE tokens, its cache filled
    with DEPTH prompt tokens: the engine, and what the point records of the model."""
    from gqakit.engines import get_engine
    from gqakit.engines.base import EngineOptions
    from gqakit.engines.llamacpp import kwargs_flash_attn

    engine = get_engine("llama.cpp")
    engine.load(path, EngineOptions(max_len=depth + decode, threads=threads))
    kv = engine.kv_allocation()
    geo = kv.detail["geometry"]
    llm = engine.llm
    t0 = time.perf_counter()
    llm.eval(prompt_ids(depth, llm.n_vocab()))
    prefill = time.perf_counter() - t0
    weights = weight_bytes_per_step(path)
    info = {"file": path.name, "heads": geo["heads"], "kv_heads": geo["kv_heads"], "kv_type": kv.detail["type_k"],
            "kv_bytes_per_token": kv.bytes_per_token, "kv_predicted": kv.detail["predicted_bytes_per_token"],
            "kv_capacity_tokens": kv.capacity_tokens, "weight_bytes_per_step": weights,
            "bytes_per_step": step_bytes(weights, kv.bytes_per_token, depth, decode),
            "macs_per_cache_byte": macs_per_cache_byte(geo["heads"], geo["kv_heads"]),
            "flash_attn": kwargs_flash_attn(llm), "prefill_threads": threads, "prefill_s": round(prefill, 3),
            "prefill_tok_per_s": round(depth / prefill, 2)}
    return engine, info


def time_decode(engine, depth: int, decode: int, threads: int, warmup: int = 2) -> list[float]:
    """DECODE single-token steps on THREADS threads from depth DEPTH, each timed as the engine's
    time_point times it: llama.cpp's decode of one token, then the argmax of its logits. WARMUP
    untimed steps go first (the thread pool wakes up), then the cache is rewound to DEPTH again."""
    import llama_cpp
    import numpy as np

    llm = engine.llm
    llama_cpp.llama_set_n_threads(llm.ctx, threads, threads)
    if llama_cpp.llama_n_threads(llm.ctx) != threads:
        raise SystemExit(f"llama.cpp did not take {threads} threads")
    steps: list[float] = []
    for n, timed in ((warmup, False), (decode, True)):
        llm.n_tokens = depth  # eval first drops the cache cells from n_tokens on: these steps decode at D+1 ..
        tok = 0
        for _ in range(n):
            s0 = time.perf_counter()
            llm.eval([tok])
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
            tok = int(logits.argmax())
            if timed:
                steps.append(time.perf_counter() - s0)
    return steps


def sources_of(a: argparse.Namespace) -> list[dict]:
    """The originals (written first when random) and their conversions, each G checked by gqakit."""
    found = []
    if not a.no_source:
        found.append({"source": a.source.name, "kind": "gguf", "path": a.source})
    if a.random_mha:
        shape = parse_mha(a.random_mha)
        path = a.workdir / f"{mha_name(shape, a.seed)}.gguf"
        if not path.is_file():
            part = path.with_suffix(".partial")
            write_random_mha(part, shape, a.seed)  # a killed write leaves only the .partial
            os.replace(part, path)
            say(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB)")
        found.append({"source": path.name, "kind": "random-mha", "shape": shape, "seed": a.seed, "path": path})
    for s in found:
        s["models"], s["skipped"] = {"original": s["path"]}, {}
        for g in a.g:
            out, why = convert(s["path"], g, a.method, a.workdir)
            if out is None:
                s["skipped"][f"g{g}"] = why
                say(f"{s['source']}: G={g} skipped: {why}")
            else:
                s["models"][f"g{g}"] = out
    return found


def run_source(src: dict, depth: int, a: argparse.Namespace, points: list[dict], save) -> None:
    import torch

    from gqakit.eval.speed.roofline import copy_bandwidth

    engines, info = {}, {}
    try:
        for name, path in src["models"].items():
            engines[name], info[name] = load_and_fill(path, depth, a.decode, a.prefill_threads)
            say(f"{src['source']} {name}: {info[name]['kv_heads']} KV heads, depth {depth} filled at "
                f"{info[name]['prefill_tok_per_s']} tok/s ({a.prefill_threads} threads)")
        for threads in a.threads:
            torch.set_num_threads(threads)
            load0, copy, speeds = os.getloadavg()[0], [], {n: [] for n in engines}
            for r in range(a.rounds):
                copy.append(copy_bandwidth("cpu") / 1e9)
                for name, engine in engines.items():
                    steps = time_decode(engine, depth, a.decode, threads)
                    speeds[name].append(a.decode / sum(steps))
                    say(f"{src['source']} depth {depth} threads {threads} round {r + 1} {name}: "
                        f"{speeds[name][-1]:.2f} tok/s, {info[name]['bytes_per_step'] * speeds[name][-1] / 1e9:.2f} "
                        f"GB/s (copy {copy[-1]:.2f} GB/s)")
            point = summarize_point({n: {**info[n], "tok_per_s": speeds[n]} for n in engines}, copy, a.memory_bound)
            points.append({"source": src["source"], "depth": depth, "threads": threads, "decode": a.decode,
                           "loadavg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)], **point})
            save()
    finally:
        for engine in engines.values():
            engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=SMOLLM2, help="a GGUF to convert and time (default: SmolLM2)")
    ap.add_argument("--no-source", action="store_true", help="time only the --random-mha source")
    ap.add_argument("--random-mha", metavar="LxHxN", help="also a random F16 Llama MHA GGUF, e.g. 12x768x12")
    ap.add_argument("--seed", type=int, default=0, help="of the random weights")
    ap.add_argument("--g", type=int, nargs="+", default=[1], help="KV heads of the conversions")
    ap.add_argument("--method", default="mean")
    ap.add_argument("--context", type=int, nargs="+", default=[4096], help="depths D")
    ap.add_argument("--decode", type=int, default=64, help="timed decode steps per model and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1],
                    help="llama.cpp (and copy) threads; on a loaded CPU, more threads than free cores make its "
                         "spinning thread pool far slower")
    ap.add_argument("--prefill-threads", type=int, default=None, help="threads that fill the cache (default: "
                                                                      "the most of --threads)")
    ap.add_argument("--memory-bound", type=float, default=0.8, metavar="FRACTION",
                    help="a point is memory-bound when the original reaches this fraction of copy bandwidth")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-llamacpp-bench"))
    ap.add_argument("--out", type=Path, default=RESULTS / "llamacpp_decode_sweep.json")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a = ap.parse_args()
    a.prefill_threads = a.prefill_threads or max(a.threads)
    if a.no_source and not a.random_mha:
        ap.error("--no-source leaves nothing to time: add --random-mha")
    if not a.no_source and not a.source.is_file():
        ap.error(f"{a.source} not found (--no-source to time only --random-mha)")
    if a.random_mha:
        try:
            parse_mha(a.random_mha)
        except ValueError as e:
            ap.error(str(e))
    if min(a.threads + a.context + [a.decode, a.rounds, a.prefill_threads]) < 1 or not 0 < a.memory_bound <= 1:
        ap.error("threads, depths, --decode and --rounds must be at least 1, --memory-bound in (0, 1]")
    if a.out.suffix != ".json":
        ap.error(f"--out {a.out}: name a .json file")
    if a.out.exists() and not a.overwrite:
        ap.error(f"--out {a.out} exists: name another file, or add --overwrite to replace it")
    import llama_cpp

    a.workdir.mkdir(parents=True, exist_ok=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    sources = sources_of(a)
    points: list[dict] = []
    result = {"command": "python -m bench.bench_llamacpp_decode " + " ".join(sys.argv[1:]),
              "llama_cpp_python": llama_cpp.__version__, "cpu": model_name(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d"),
              "memory_bound_threshold": a.memory_bound, "method": a.method, "decode": a.decode, "rounds": a.rounds,
              "prefill_threads": a.prefill_threads, "loadavg_1min_start": round(os.getloadavg()[0], 2),
              "sources": [{k: (str(v) if isinstance(v, Path) else v) for k, v in s.items() if k != "models"}
                          | {"models": {n: p.name for n, p in s["models"].items()}} for s in sources],
              "points": points, "complete": False}

    def save() -> None:
        write_json(a.out, result)

    for src in sources:
        for depth in a.context:
            run_source(src, depth, a, points, save)
    result["complete"] = True
    result["loadavg_1min_end"] = round(os.getloadavg()[0], 2)
    save()
    print(markdown_table(points))
    print(f"\nmemory-bound: the original's step at >= {a.memory_bound:.0%} of the copy bandwidth of the same threads")
    for p in points:
        for name, m in p["models"].items():
            if "ratio" in m:
                print(f"{p['source']} {name} depth {p['depth']} threads {p['threads']}: {m['ratio']:.2f}x vs "
                      f"{m['predicted_ratio']:.2f}x predicted, {m['of_prediction']:.0%} of the prediction "
                      f"({'memory-bound' if p['memory_bound'] else 'not memory-bound'})")


if __name__ == "__main__":
    main()
