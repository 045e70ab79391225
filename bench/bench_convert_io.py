"""Conversion IO benchmark: throughput against `cp` and peak anonymous memory.

Builds a synthetic Llama-shaped MHA checkpoint (random normal values, bf16, sharded
safetensors), then in one run times
  1. `cp -r` of the checkpoint (the IO floor: read + write of the same bytes),
  2. `gqakit convert` of it to G KV heads (in a subprocess, RssAnon sampled every 10 ms),
  3. `cp -r` again (to bracket drift),
and prints a Markdown row. Run:

    .venv/bin/python -m bench.bench_convert_io --workdir /tmp/gqakit-bench

Sizes default to a 1.26B-parameter Llama (hidden 2048, 22 layers, 32 heads, MHA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import baseline_python_rss, folder_bytes, timed_convert, write_random_llama_checkpoint


def timed_cp(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    os.sync()
    return time.perf_counter() - t


def import_seconds() -> float:
    """Wall time of a process that only starts Python and imports the convert stack."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import gqakit.convert.pipeline, gqakit.convert.methods"], check=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-bench"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("-g", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = ap.parse_args()
    src = args.workdir / "src"
    if not (src / "model.safetensors.index.json").exists() and not (src / "model.safetensors").exists():
        print("building synthetic checkpoint ...", flush=True)
        n = write_random_llama_checkpoint(src, {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                                                "intermediate": args.intermediate, "vocab": args.vocab})
    else:
        n = sum(torch.Size(v["shape"]).numel() for f in src.glob("*.safetensors")
                for k, v in _header(f).items() if k != "__metadata__")
    size = folder_bytes(src)
    cp1 = timed_cp(src, args.workdir / "cp")
    conv, anon, hwm = timed_convert(src, args.workdir / "out", args.g)
    cp2 = timed_cp(src, args.workdir / "cp")
    out_size = folder_bytes(args.workdir / "out")
    base = baseline_python_rss()
    startup = import_seconds()
    largest = max(v["shape"][0] * (v["shape"][1] if len(v["shape"]) > 1 else 1) * 2
                  for f in src.glob("*.safetensors") for k, v in _header(f).items() if k != "__metadata__")
    cp = (cp1 + cp2) / 2
    res = {"params": n, "source_bytes": size, "output_bytes": out_size, "cp_seconds": [round(cp1, 2), round(cp2, 2)],
           "convert_seconds": round(conv, 2), "convert_vs_cp_time": round(conv / cp, 2),
           "startup_import_seconds": round(startup, 2),
           "throughput_ratio_vs_cp_excluding_startup": round(((size + out_size) / max(conv - startup, 1e-9))
                                                            / ((2 * size) / cp), 2),
           "throughput_ratio_vs_cp": round(((size + out_size) / conv) / ((2 * size) / cp), 2),
           "peak_rss_anon_bytes": anon, "vmhwm_bytes": hwm, "import_only_rss_anon_bytes": base,
           "largest_tensor_bytes": largest, "cpu": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "torch": torch.__version__}
    print(json.dumps(res, indent=2))
    gib = 2 ** 30
    print(f"\n| {n / 1e9:.2f}B params, bf16, {size / gib:.2f} GiB, MHA {args.heads} -> {args.g} KV heads "
          f"| cp {cp:.1f} s | convert {conv:.1f} s (of which {startup:.1f} s Python start-up and imports) "
          f"| throughput {res['throughput_ratio_vs_cp']:.2f}x of cp "
          f"({res['throughput_ratio_vs_cp_excluding_startup']:.2f}x without start-up) "
          f"| peak RssAnon {anon / gib:.2f} GiB (imports alone {base / gib:.2f} GiB; largest tensor "
          f"{largest / gib:.2f} GiB) |")
    if not args.keep:
        shutil.rmtree(args.workdir / "cp", ignore_errors=True)
        shutil.rmtree(args.workdir / "out", ignore_errors=True)


def _header(path: Path) -> dict:
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


if __name__ == "__main__":
    main()
