"""GGUF -> model folder streams: peak memory of a 7B-layer-shaped Llama GGUF, and every
output tensor against transformers' own dequantisation of the same file.

A Llama GGUF with Llama-2-7B's layer shape (hidden 4096, 32 heads, MLP 11008; vocabulary
`--vocab`, 49,152 by default) but 4 layers (1.21 B parameters; 2.3 GiB as F16), random
weights, written here with the `gguf` package tensor by tensor, q/k rows permuted as
llama.cpp's converter does. Then, each in a subprocess as a user runs it (`gqakit convert
SRC.gguf OUTDIR -g G --method mean -q`, float32 output):
  - G = 8: peak RssAnon (sampled every 10 ms; the memory-mapped input's pages are
    file-backed and not counted) and VmHWM;
  - G = 32 (= the source's KV heads, so mean pooling changes nothing): the same, and then
    every output tensor is compared bit for bit with transformers'
    `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` in float32 (which holds the
    whole model, 4.5 GiB, in this process).
Memory is reported above the bare runtime: a process that imports torch, transformers' model
classes, gguf and gqakit's convert stack, and nothing else.

    .venv/bin/python -m bench.bench_gguf_stream [--qtype Q8_0] [--layers 4] [--vocab 128256 --g 8 --no-compare]

Writes bench/results/gguf_stream.json.
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

import numpy as np

from bench.common import LLAMA2_7B, RESULTS, say, timed_convert

GIB = 2 ** 30
MIB = 2 ** 20


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def bare_runtime_rss() -> int:
    """RssAnon of a process that only imports the runtime a GGUF conversion needs: torch,
    transformers' model classes, gguf and gqakit's convert stack."""
    code = ("import gqakit.convert.pipeline, gqakit.convert.methods, gqakit.convert.gguf_in, gguf, pathlib;"
            "from transformers import AutoModelForCausalLM, LlamaForCausalLM;"
            "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() "
            "if l.startswith('RssAnon')][0].split()[1])")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) * 1024


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, shape: dict, layers: int, qtype_name: str, seed: int = 0) -> None:
    """A random Llama GGUF of SHAPE with LAYERS blocks, 2-D weights in QTYPE (F16 or Q8_0),
    norms in F32; written one tensor at a time (memory: one tensor)."""
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
    from gguf.quants import quantize

    qtype = QT[qtype_name]
    h, heads, ff, vocab = shape["hidden"], shape["heads"], shape["intermediate"], shape["vocab"]
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h))]
    for i in range(layers):
        tensors += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (h, h)),
                    (f"blk.{i}.attn_k.weight", (h, h)), (f"blk.{i}.attn_v.weight", (h, h)),
                    (f"blk.{i}.attn_output.weight", (h, h)), (f"blk.{i}.ffn_norm.weight", (h,)),
                    (f"blk.{i}.ffn_gate.weight", (ff, h)), (f"blk.{i}.ffn_up.weight", (ff, h)),
                    (f"blk.{i}.ffn_down.weight", (h, ff))]
    tensors += [("output_norm.weight", (h,)), ("output.weight", (vocab, h))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(h // heads)
    tokens = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(vocab - 3)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_string("general.name", "llama-7b-layers")
    block, size = GGML_QUANT_SIZES[qtype]
    for name, shp in tensors:
        if len(shp) == 1:
            w.add_tensor_info(name, shp, np.dtype(np.float32), shp[0] * 4)
        elif qtype == QT.F16:
            w.add_tensor_info(name, shp, np.dtype(np.float16), shp[0] * shp[1] * 2)
        else:
            byte_shape = (shp[0], shp[1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp in tensors:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, dtype=np.float32) + rng.standard_normal(shp, dtype=np.float32) * 0.01)
            continue
        a = rng.standard_normal(shp, dtype=np.float32) * 0.02
        if ".attn_q." in name or ".attn_k." in name:
            a = permute(a, heads)
        w.write_tensor_data(a.astype(np.float16) if qtype == QT.F16 else quantize(a, qtype))
        del a
    w.close()


def compare_with_transformers(gguf_path: Path, out: Path) -> dict:
    """Every tensor of OUT against transformers' float32 load of GGUF_PATH, bit for bit."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ref = model.state_dict()
    files = sorted(out.glob("*.safetensors"))
    seen, differ, bits = 0, [], []
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                t, r = h.get_tensor(name), ref[name].contiguous()
                seen += 1
                if t.dtype != r.dtype or not torch.equal(t, r):
                    differ.append(name)
                elif not torch.equal(t.view(torch.uint8), r.view(torch.uint8)):
                    bits.append(name)  # equal values, other bits: a -0.0 the method's mean made +0.0
    missing = sorted(set(ref) - {n for f in files for n in safe_open(str(f), framework="pt").keys()}
                     - ({"lm_head.weight"} if model.config.tie_word_embeddings else set()))
    return {"tensors_compared": seen, "tensors_differing": differ, "tensors_missing": missing,
            "equal_values_other_bits": bits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--qtype", default="F16", choices=["F16", "Q8_0"])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--g", type=int, nargs="+", default=[8, 32], help="KV heads to convert to (32: the check)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gqakit-gguf-stream"))
    ap.add_argument("--no-compare", action="store_true", help="skip the check against transformers (4 GiB)")
    ap.add_argument("--out", type=Path, default=RESULTS / "gguf_stream.json")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    shape = {**LLAMA2_7B, "vocab": a.vocab}
    src = a.workdir / f"llama-7b-layers-{a.layers}-vocab-{a.vocab}.{a.qtype}.gguf"
    if not src.is_file():
        say(f"writing {src}")
        t = time.perf_counter()
        write_llama_gguf(src, shape, a.layers, a.qtype)
        say(f"wrote {src.stat().st_size / GIB:.2f} GiB in {time.perf_counter() - t:.0f} s")
    base = bare_runtime_rss()
    runs = {}
    for g in a.g:
        out = a.workdir / f"out-g{g}"
        seconds, anon, hwm = timed_convert(src, out, g, ("--force",) if g == shape["heads"] else ())
        runs[f"g{g}"] = {"seconds": round(seconds, 1), "peak_rss_anon": anon, "above_bare_runtime": anon - base,
                         "vm_hwm": hwm, "out_bytes": sum(p.stat().st_size for p in out.iterdir())}
        say(f"G={g}: {seconds:.0f} s, peak RssAnon {anon / GIB:.2f} GiB ({(anon - base) / MIB:.0f} MiB above the "
            f"bare runtime's {base / MIB:.0f} MiB), VmHWM {hwm / GIB:.2f} GiB")
        if g != 32 or a.no_compare:
            shutil.rmtree(out)
    check = None if a.no_compare or 32 not in a.g else compare_with_transformers(src, a.workdir / "out-g32")
    if check is not None:
        say(f"against transformers: {check['tensors_compared']} tensors compared, "
            f"{len(check['tensors_differing'])} differ, {len(check['tensors_missing'])} missing, "
            f"{len(check['equal_values_other_bits'])} equal in value but not bit for bit")
    shutil.rmtree(a.workdir / "out-g32", ignore_errors=True)
    result = {"source": src.name, "source_bytes": src.stat().st_size, "qtype": a.qtype, "layers": a.layers,
              "shape": {**shape, "layers": a.layers}, "method": "mean",
              "machine": f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d"),
              "bare_runtime_rss_anon": base, "runs": runs, "check": check}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    worst = max(r["above_bare_runtime"] for r in runs.values())
    ok = worst <= 512 * MIB and (check is None or not (check["tensors_differing"] or check["tensors_missing"]))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
