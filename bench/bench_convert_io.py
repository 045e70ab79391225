"""Conversion IO benchmark: throughput against `cp` and peak anonymous memory.

Builds a synthetic Llama-shaped MHA checkpoint (random normal values, bf16, sharded
safetensors), then in one run times
  1. `cp -r` of the checkpoint (the IO floor: read + write of the same bytes),
  2. `gqakit convert` of it to G KV heads (in a subprocess, RssAnon sampled every 10 ms),
  3. `cp -r` again (to bracket drift),
and prints a Markdown row. Run:

    .venv/bin/python bench/bench_convert_io.py --workdir /tmp/gqakit-bench

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
import threading
import time
from pathlib import Path

import torch


def build_checkpoint(folder: Path, hidden: int, layers: int, heads: int, inter: int, vocab: int) -> int:
    """Write a random Llama checkpoint tensor by tensor (never the whole model in memory)."""
    from transformers import LlamaConfig

    from gqakit.convert.io import Planned, ShardWriter

    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                      tie_word_embeddings=False, dtype="bfloat16")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(folder)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (hidden, hidden),
                       p + "self_attn.v_proj.weight": (hidden, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    plan = [Planned(n, torch.bfloat16, s) for n, s in shapes.items()]
    writer = ShardWriter(folder, plan, 2_000_000_000)
    gen = torch.Generator().manual_seed(0)
    for p in plan:
        writer.write(p.name, (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.finish()
    return sum(torch.Size(p.shape).numel() for p in plan)


def du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def timed_cp(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    os.sync()
    return time.perf_counter() - t


def timed_convert(src: Path, out: Path, g: int, extra: tuple[str, ...] = ()) -> tuple[float, int, int]:
    """Seconds, peak RssAnon (bytes, sampled) and VmHWM (bytes) of a convert subprocess."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "gqakit", "convert", str(src), str(out), "-g", str(g), "--method", "mean", "-q", *extra]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd)
    peak = {"anon": 0, "hwm": 0}

    def sample() -> None:
        while proc.poll() is None:
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith(("RssAnon:", "VmHWM:")):
                        key = "anon" if line.startswith("RssAnon") else "hwm"
                        peak[key] = max(peak[key], int(line.split()[1]) * 1024)
            except (FileNotFoundError, ProcessLookupError):
                break
            time.sleep(0.01)

    th = threading.Thread(target=sample)
    th.start()
    if proc.wait() != 0:
        raise SystemExit("convert failed")
    os.sync()
    elapsed = time.perf_counter() - t
    th.join()
    return elapsed, peak["anon"], peak["hwm"]


def import_seconds() -> float:
    """Wall time of a process that only starts Python and imports the convert stack."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import gqakit.convert.pipeline, gqakit.convert.methods"], check=True)
    return time.perf_counter() - t


def baseline_python_rss() -> int:
    """RssAnon of a process that only imports gqakit's convert stack (torch, transformers)."""
    code = ("import gqakit.convert.pipeline, gqakit.convert.methods, pathlib;"
            "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('RssAnon')][0].split()[1])")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) * 1024


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
        n = build_checkpoint(src, args.hidden, args.layers, args.heads, args.intermediate, args.vocab)
    else:
        n = sum(torch.Size(v["shape"]).numel() for f in src.glob("*.safetensors")
                for k, v in _header(f).items() if k != "__metadata__")
    size = du(src)
    cp1 = timed_cp(src, args.workdir / "cp")
    conv, anon, hwm = timed_convert(src, args.workdir / "out", args.g)
    cp2 = timed_cp(src, args.workdir / "cp")
    out_size = du(args.workdir / "out")
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
