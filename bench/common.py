"""What several benchmark scripts share: where the assets are, random Llama-shaped models,
"load a model, then its perplexity", a timed `gqakit convert` subprocess, and result files.

Scripts run from the repository root as `python -m bench.NAME`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# ../shared: stories260K, WikiText-2, the TinyStories excerpt (GQAKIT_SHARED overrides it).
SHARED = Path(os.environ.get("GQAKIT_SHARED", REPO.parent / "shared"))
# The SmolLM2-135M GGUF that `gqakit demo` caches (GQAKIT_SMOLLM2 overrides it).
SMOLLM2 = Path(os.environ.get("GQAKIT_SMOLLM2",
                              Path.home() / ".cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))

# Llama-2-7B: hidden 4096, 32 layers, 32 heads (MHA), MLP 11008, vocab 32000.
LLAMA2_7B = {"hidden": 4096, "layers": 32, "heads": 32, "intermediate": 11008, "vocab": 32000}
# TinyLlama-1.1B's shape: hidden 2048, 22 layers, 32 heads, MLP 5632, vocab 32000.
LLAMA_1B = {"hidden": 2048, "layers": 22, "heads": 32, "intermediate": 5632, "vocab": 32000}


def say(msg: str) -> None:
    """One progress line on stderr, tagged with the script's name and the time, flushed at once
    (the log of a run killed by its time limit keeps it)."""
    print(f"[{Path(sys.argv[0]).stem} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def append_jsonl(path: Path | str, row: dict[str, Any]) -> None:
    """Add one result row to a JSON-lines file (results are appended, never rewritten)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: a step killed by its time limit leaves the last complete version."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def random_llama(shape: dict[str, Any], kv_heads: int, *, device: str = "cpu", dtype: Any = None,
                 positions: int = 4096, seed: int = 0, **config: Any) -> Any:
    """A Llama-shaped causal LM with transformers' random initialisation (never zeros), built on
    `device` itself (a 7B-shaped model initialised on the host first takes minutes).
    `shape`: hidden, layers, heads, intermediate, vocab; `config`: more LlamaConfig fields."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    cfg = LlamaConfig(hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                      num_attention_heads=shape["heads"], num_key_value_heads=kv_heads,
                      intermediate_size=shape["intermediate"], vocab_size=shape["vocab"],
                      max_position_embeddings=positions, tie_word_embeddings=False, **config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32).eval()
    assert all(p.abs().sum() > 0 for p in model.parameters() if p.dim() > 1), "weights must not be zeros"
    return model


def write_random_llama_checkpoint(folder: Path, shape: dict[str, Any], kv_heads: int | None = None) -> int:
    """Write a random bf16 Llama checkpoint tensor by tensor (never the whole model in memory):
    normal values with sigma 0.02, norms included; returns its parameter count."""
    import torch
    from transformers import LlamaConfig

    from gqakit.convert.io import Planned, ShardWriter

    hidden, layers, heads, inter, vocab = (shape[k] for k in ("hidden", "layers", "heads", "intermediate", "vocab"))
    kv = kv_heads or heads
    kv_dim = hidden // heads * kv
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                      tie_word_embeddings=False, dtype="bfloat16")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(folder)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_dim, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
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


def perplexity(path: Path | str, data: Path | str, max_chars: int | None = None, *, threads: int | None = None,
               device: str = "cpu", context: int = 512, stride: int | None = None) -> float:
    """Load a model folder or GGUF file in fp32, then its token perplexity on a text file
    (sliding window `context`/`stride`, BOS prepended). `threads`: torch threads on the CPU
    (default: $OMP_NUM_THREADS, else every core)."""
    import torch

    from gqakit.eval.perplexity import PerplexitySettings, Window
    from gqakit.eval.runner import perplexity_of_file

    if device == "cpu":
        torch.set_num_threads(threads or int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    settings = PerplexitySettings(data=data, window=Window(context=context, stride=stride), max_chars=max_chars)
    res = perplexity_of_file(path, settings, device=device, dtype="float32", quiet=True)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res.perplexity.token_perplexity


def timed_convert(src: Path, out: Path, g: int, extra: tuple[str, ...] = ()) -> tuple[float, int, int]:
    """`gqakit convert SRC OUT -g G --method mean` in a subprocess (replacing OUT first), then
    `sync`: seconds, peak RssAnon (bytes, sampled every 10 ms) and VmHWM (bytes)."""
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


def baseline_python_rss() -> int:
    """RssAnon of a process that only imports gqakit's convert stack (torch, transformers)."""
    code = ("import gqakit.convert.pipeline, gqakit.convert.methods, pathlib;"
            "print([l for l in pathlib.Path('/proc/self/status').read_text().splitlines() if l.startswith('RssAnon')][0].split()[1])")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) * 1024
