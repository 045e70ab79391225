"""The uptraining memory plan against the measured peak, on the CPU.

For each model size (random Llamas built in code: pico, a middle one, SmolLM2-135M's
shape), converted with `gqakit convert`, and each mode (all weights / attention only /
LoRA r 8 on the default targets, with / without gradient checkpointing), one subprocess runs two optimizer steps of the
uptrain recipe and reports its peak RSS (VmHWM) minus its RSS before the model was
loaded (with glibc's mmap threshold fixed, see MALLOC); the prediction is the `memory_plan` row the run wrote first in log.jsonl (the
figure `gqakit uptrain --dry-run` prints).

    python -m bench.uptrain_memory                       # every size and mode, a table on stdout
    python -m bench.uptrain_memory --sizes pico --out /tmp/m.jsonl
    python -m bench.uptrain_memory --sizes mid,smollm2-135m --modes lora   # the LoRA rows only

Rows go to bench/results/uptrain_memory.jsonl (appended) unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, SHARED, append_jsonl, say

# name -> Llama shape (MHA; converted to kv_heads), seq_len, micro_batch
SIZES: dict[str, dict[str, Any]] = {
    "pico": dict(hidden=64, layers=2, heads=4, kv=2, intermediate=128, vocab=512, tied=False, seq_len=64, micro_batch=2),
    "mid": dict(hidden=256, layers=8, heads=8, kv=2, intermediate=768, vocab=8192, tied=False, seq_len=128,
                micro_batch=4),
    "smollm2-135m": dict(hidden=576, layers=30, heads=9, kv=3, intermediate=1536, vocab=49152, tied=True,
                         seq_len=256, micro_batch=4),
}
MODES = {"all": None, "attention": ["self_attn"], "lora": None}
LORA = {"r": 8}  # train.lora of the "lora" mode: default targets (K and V after `mean`)
# glibc's mmap threshold, fixed: a freed tensor goes back to the OS, so RSS follows the live
# tensors (as torch's max_memory_allocated does on a GPU) instead of the heap's high-water mark.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
TEXT = " ".join(f"Once upon a time there was a little {w} who liked to play in the {p}."
                for w in ("dog", "cat", "girl", "boy", "bird") for p in ("park", "garden", "sun", "rain")) * 40


def status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def build(name: str, work: Path) -> Path:
    """A random MHA Llama of the size, with stories260K's tokenizer, converted to its KV heads."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    s = SIZES[name]
    src, dst = work / f"{name}-mha", work / f"{name}-gqa"
    cfg = LlamaConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["heads"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
                      max_position_embeddings=2048, tie_word_embeddings=s["tied"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy2(SHARED / "models" / "stories260K" / f, src / f)
    subprocess.run([sys.executable, "-m", "gqakit", "convert", str(src), str(dst), "-g", str(s["kv"]),
                    "--method", "mean", "-q"], check=True, cwd=REPO)
    return dst


def _config(model: Path, name: str, mode: str, ckpt: bool, run: Path) -> dict[str, Any]:
    s = SIZES[name]
    return {"model": {"path": str(model)}, "data": {"texts": [TEXT] * 8},
            "train": {"tokens": 2 * s["seq_len"] * s["micro_batch"], "seq_len": s["seq_len"],
                      "micro_batch": s["micro_batch"], "grad_accum": 1, "precision": "fp32", "cpu": True,
                      "gradient_checkpointing": ckpt, "trainable": MODES[mode], "warmup_steps": 0,
                      **({"lora": LORA} if mode == "lora" else {})},
            "output": {"dir": str(run)}, "logging": {"every": 1, "tensorboard": False}}


def one(model: Path, name: str, mode: str, ckpt: bool, run: Path, warm: Path) -> dict[str, Any]:
    """In this process: two optimizer steps; peak RSS minus the RSS before the model loads.

    A pico run goes first, so the libraries the recipe imports on its way (tokenizers,
    datasets, safetensors) and their caches are in the baseline, not in the figure; the
    kernel's peak-RSS mark is then reset (/proc/self/clear_refs)."""
    import gqakit.uptrain.trainer as trainer
    from gqakit.uptrain.preflight import preflight

    warm_recipe = trainer.UptrainRecipe(preflight(_config(warm, "pico", mode, ckpt, run.with_name("warm"))), quiet=True)
    warm_recipe.setup()
    warm_recipe.train()
    del warm_recipe
    import gc

    gc.collect()
    recipe = trainer.UptrainRecipe(preflight(_config(model, name, mode, ckpt, run)), quiet=True)
    Path("/proc/self/clear_refs").write_text("5")
    base, base_anon = status_bytes("VmRSS"), status_bytes("RssAnon")
    peak_anon, done = [base_anon], threading.Event()

    def sample() -> None:  # anonymous memory every 2 ms: the checkpoint's mapped file pages left out
        while not done.wait(0.002):
            peak_anon[0] = max(peak_anon[0], status_bytes("RssAnon"))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    recipe.setup()
    recipe.train()
    done.set()
    th.join()
    peak = status_bytes("VmHWM")
    s = SIZES[name]
    rows = [json.loads(r) for r in (run / "log.jsonl").read_text().splitlines()]
    plan = next(r["memory_plan"] for r in rows if "memory_plan" in r)
    measured = peak - base
    anon = peak_anon[0] - base_anon
    return {"size": name, "mode": mode, "gradient_checkpointing": ckpt, "seq_len": s["seq_len"],
            "micro_batch": s["micro_batch"], "params": plan["params"], "trained": plan["trained"],
            "predicted_bytes": plan["peak_bytes"], "measured_bytes": measured,
            "error": round(plan["peak_bytes"] / measured - 1, 4), "measured_anon_bytes": anon,
            "error_anon": round(plan["peak_bytes"] / anon - 1, 4), "parts_bytes": plan["parts_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: " + ", ".join(SIZES))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--out", type=Path, default=RESULTS / "uptrain_memory.jsonl")
    ap.add_argument("--one", nargs=5, metavar=("MODEL", "SIZE", "MODE", "CKPT", "WARM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        model, name, mode, ckpt, warm = args.one
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(Path(model), name, mode, ckpt == "1", Path(tmp) / "run", Path(warm))))
        return
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        sys.exit(f"uptrain_memory: unknown size {bad[0]!r}; choose from {', '.join(SIZES)}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        sys.exit(f"uptrain_memory: unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    machine = f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip()
    print("| size | params | mode | checkpointing | predicted | measured | error |\n|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        warm = build("pico", Path(tmp))
        for name in sizes:
            model = warm if name == "pico" else build(name, Path(tmp))
            for mode in modes:
                for ckpt in (False, True):
                    say(f"{name} {mode} checkpointing={ckpt}")
                    r = subprocess.run([sys.executable, "-m", "bench.uptrain_memory", "--one", str(model), name, mode,
                                        "1" if ckpt else "0", str(warm)], cwd=REPO, capture_output=True, text=True,
                                       env={**os.environ, **MALLOC})
                    if r.returncode != 0:
                        sys.exit(f"uptrain_memory: the {name} {mode} run failed:\n{r.stderr[-2000:]}")
                    row = json.loads(r.stdout.strip().splitlines()[-1])
                    row.update(date=time.strftime("%Y-%m-%d"), machine=machine,
                               command=" ".join(["python -m bench.uptrain_memory", *sys.argv[1:]]))
                    append_jsonl(args.out, row)
                    print(f"| {name} | {row['params'] / 1e6:.2f}M | {mode} | {'yes' if ckpt else 'no'} | "
                          f"{row['predicted_bytes'] / 2**20:,.1f} MiB | {row['measured_bytes'] / 2**20:,.1f} MiB | "
                          f"{row['error']:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
