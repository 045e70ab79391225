"""Conversion IO benchmark: throughput against `cp`, CPU time and peak anonymous memory.

Builds a synthetic Llama-shaped MHA checkpoint (random normal values, bf16, sharded
safetensors), then for ROUNDS rounds, alternating which goes first, times
  - `cp -r` of the checkpoint (the IO floor: read + write of the same bytes),
  - `gqakit convert` of it to G KV heads (`--method mean -q`, in a subprocess, RssAnon
    sampled every 10 ms),
  - a process that only starts Python, imports the convert stack and exits as the convert
    command does (start-up),
each followed by `sync`, and each started from a settled disk and a cached source (`settle`:
the earlier outputs deleted and written out 3 s before, the source read into the page cache).
Throughput is (bytes read + written) / s over `cp`'s, per round (each conversion against the
`cp` of its own round), with and without the start-up; CPU
time (user + system, and the system part alone: the kernel's copies) of each child from
`getrusage`. Prints medians, the spread (min-max) and the load average before and after. Run:

    .venv/bin/python -m bench.bench_convert_io --workdir /tmp/gqakit-bench --rounds 7

Sizes default to a 1.26B-parameter Llama (hidden 2048, 22 layers, 32 heads, MHA).
Writes bench/results/convert_io.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import RESULTS, baseline_python_rss, folder_bytes, timed_convert, write_random_llama_checkpoint


def children_cpu() -> tuple[float, float]:
    """(user + system, system) CPU seconds of the waited-for child processes so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime, r.ru_stime


def with_cpu(run: Callable[[], object]) -> tuple[object, float, float]:
    """RUN's result and the CPU seconds its child processes used (they are waited for): all, and
    the system part alone."""
    before = children_cpu()
    got = run()
    after = children_cpu()
    return got, after[0] - before[0], after[1] - before[1]


def settle(src: Path, pause: float) -> None:
    """Before a timed step: every write so far on disk (the rounds delete 2+ GiB of output), then
    PAUSE seconds, then SRC's files read into the page cache (the kernel may have reclaimed them).
    The pause gives `cp` and `gqakit convert` (which writes only after its imports) the same time
    since the last deletion, as the kernel (or a VM's memory balloon) may still be taking back the
    freed memory."""
    os.sync()
    time.sleep(pause)
    for f in sorted(src.iterdir()):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def timed_cp(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    os.sync()
    return time.perf_counter() - t


def import_seconds() -> float:
    """Wall time of a process that only starts Python, imports the convert stack and exits as
    `gqakit convert` does (`skip_exit_collections`)."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import gqakit.cli, gqakit.convert.pipeline, gqakit.convert.methods, "
                    "gqakit.convert.cli as c; c.skip_exit_collections()"], check=True)
    return time.perf_counter() - t


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def spread(values: list[float]) -> dict[str, float]:
    values = [v for v in values if v == v] or [float("nan")]  # without NaNs
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-bench"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("-g", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "convert_io.json")
    ap.add_argument("--keep", action="store_true", help="keep the files afterwards")
    ap.add_argument("--pause", type=float, default=3.0,
                    help="seconds between the earlier outputs' deletion and each timed step (`settle`)")
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
    load_before = os.getloadavg()
    rows = []
    for r in range(args.rounds):
        row: dict[str, float] = {}

        def cp() -> None:
            row["cp_seconds"], row["cp_cpu"], row["cp_sys_cpu"] = with_cpu(lambda: timed_cp(src, args.workdir / "cp"))

        def convert() -> None:
            (sec, anon, hwm), row["convert_cpu"], row["convert_sys_cpu"] = with_cpu(
                lambda: timed_convert(src, args.workdir / "out", args.g))
            row.update(convert_seconds=sec, peak_rss_anon=anon, vm_hwm=hwm)
            row["output_bytes"] = folder_bytes(args.workdir / "out")  # before the next step's `settle` deletes it

        def startup() -> None:
            row["startup_seconds"], row["startup_cpu"], row["startup_sys_cpu"] = with_cpu(import_seconds)

        for step in ((cp, convert, startup) if r % 2 == 0 else (startup, convert, cp)):
            for old in ("cp", "out"):  # the deletions before the timer, and written out (`settle`)
                shutil.rmtree(args.workdir / old, ignore_errors=True)
            settle(src, args.pause)
            step()
        out_size = int(row.pop("output_bytes"))
        cp_rate = 2 * size / row["cp_seconds"]
        row["ratio"] = (size + out_size) / row["convert_seconds"] / cp_rate
        work = row["convert_seconds"] - row["startup_seconds"]  # noise can make it <= 0 on a tiny model
        row["ratio_without_startup"] = (size + out_size) / work / cp_rate if work > 0 else float("nan")
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        print(f"round {r + 1}: " + ", ".join(f"{k} {v}" for k, v in rows[-1].items()), file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    largest = max(v["shape"][0] * (v["shape"][1] if len(v["shape"]) > 1 else 1) * 2
                  for f in src.glob("*.safetensors") for k, v in _header(f).items() if k != "__metadata__")
    keys = ("cp_seconds", "convert_seconds", "startup_seconds", "ratio", "ratio_without_startup", "cp_cpu",
            "convert_cpu", "startup_cpu", "cp_sys_cpu", "convert_sys_cpu", "startup_sys_cpu", "peak_rss_anon")
    res = {"params": n, "source_bytes": size, "output_bytes": out_size, "g": args.g, "rounds": rows,
           "summary": {k: spread([row[k] for row in rows]) for k in keys},
           "load_average_before": [round(x, 2) for x in load_before],
           "load_average_after": [round(x, 2) for x in load_after],
           "import_only_rss_anon_bytes": baseline_python_rss(), "largest_tensor_bytes": largest,
           "pause_seconds": args.pause, "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["summary"], indent=2))
    s, gib = res["summary"], 2 ** 30

    def fmt(k: str, unit: str = "") -> str:
        return f"{s[k]['median']:.2f}{unit} ({s[k]['min']:.2f}-{s[k]['max']:.2f})"
    print(f"\n{n / 1e9:.2f}B params, bf16, {size / gib:.2f} GiB, MHA {args.heads} -> {args.g} KV heads, "
          f"{args.rounds} rounds, load {load_before[0]:.1f} -> {load_after[0]:.1f}:\n"
          f"| cp {fmt('cp_seconds', ' s')} | convert {fmt('convert_seconds', ' s')}, start-up "
          f"{fmt('startup_seconds', ' s')} | throughput {fmt('ratio', 'x')} of cp, "
          f"{fmt('ratio_without_startup', 'x')} without start-up | CPU s: cp {fmt('cp_cpu')}, convert "
          f"{fmt('convert_cpu')}, start-up {fmt('startup_cpu')} (system: cp {fmt('cp_sys_cpu')}, convert "
          f"{fmt('convert_sys_cpu')}, start-up {fmt('startup_sys_cpu')}) | peak RssAnon "
          f"{s['peak_rss_anon']['max'] / gib:.2f} GiB (imports alone {res['import_only_rss_anon_bytes'] / gib:.2f} "
          f"GiB; largest tensor {largest / gib:.2f} GiB) |")
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
