"""GGUF -> GGUF conversion: time, peak memory, and what changed, on a real quantised GGUF.

For SmolLM2-135M-Instruct Q4_1 (3 KV heads, 30 layers) converted to G=1, in alternating
order within one run:
  - `gqakit convert SRC.gguf OUT.gguf -g G` (memory-mapped, tensor by tensor);
  - `gqakit convert SRC.gguf OUTDIR -g G` (the folder output of the same conversion, read
    through the same memory-mapped reader, written as float32).
Each in a subprocess, as a user runs it; peak RssAnon sampled every 10 ms (file-backed
pages of the memory-mapped input are not counted), next to a process that only imports the
stack. Also counts the tensors of OUT.gguf that are byte-identical to SRC's.

    .venv/bin/python -m bench.bench_gguf_convert --rounds 2

Writes bench/results/gguf_convert.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path

from bench.common import RESULTS, SMOLLM2, baseline_python_rss, timed_convert


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=SMOLLM2)
    ap.add_argument("--g", type=int, default=1)
    ap.add_argument("--method", default="mean")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-gguf-bench"))
    ap.add_argument("--out", type=Path, default=RESULTS / "gguf_convert.json")
    a = ap.parse_args()
    from gguf import GGUFReader

    a.workdir.mkdir(parents=True, exist_ok=True)
    out_file, out_dir = a.workdir / "out.gguf", a.workdir / "outdir"
    runs: dict[str, list] = {"gguf": [], "folder": []}
    extra = ("--method", a.method)
    for r in range(a.rounds):
        out_file.unlink(missing_ok=True)
        runs["gguf"].append(timed_convert(a.source, out_file, a.g, extra))
        shutil.rmtree(out_dir, ignore_errors=True)
        runs["folder"].append(timed_convert(a.source, out_dir, a.g, extra))
        print(f"round {r + 1}: gguf {runs['gguf'][-1]}, folder {runs['folder'][-1]}", file=sys.stderr)
    src, out = GGUFReader(a.source), GGUFReader(out_file)
    st = {t.name: t for t in src.tensors}
    same = sum(bytes(t.data) == bytes(st[t.name].data) and t.tensor_type == st[t.name].tensor_type for t in out.tensors)
    base = baseline_python_rss()
    gib = 2 ** 30
    result = {"source": a.source.name, "source_bytes": a.source.stat().st_size, "out_bytes": out_file.stat().st_size,
              "g": a.g, "method": a.method, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "tensors": len(out.tensors), "byte_identical_tensors": same, "imports_rss_anon": base,
              "runs": {k: [{"seconds": round(s, 2), "peak_rss_anon": an, "vm_hwm": hw} for s, an, hw in v]
                       for k, v in runs.items()}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| output | seconds (per round) | peak RssAnon (max over rounds) |\n|---|---|---|")
    for k, label in (("gguf", "one .gguf file"), ("folder", "safetensors folder")):
        v = result["runs"][k]
        print(f"| {label} | {', '.join(str(x['seconds']) for x in v)} | "
              f"{max(x['peak_rss_anon'] for x in v) / gib:.2f} GiB |")
    print(f"\nimports alone: {base / gib:.2f} GiB; {same} of {len(out.tensors)} tensors byte-identical to the source; "
          f"{a.source.stat().st_size / 2**20:.1f} MiB -> {out_file.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
