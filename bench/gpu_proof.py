"""The steps of `bench/gpu_proof.sh`: sizes, synthetic models and text, uptrain MFU, summary.

`bench/gpu_proof.sh` runs every GPU measurement in one call, on a GPU machine without
internet or `../shared` (everything is built here, in code); each step is a separate
process with its own time limit:

    python -m bench.gpu_proof decode  --profile gpu --out OUT --work WORK   # bench/bench_decode.py grid
    python -m bench.gpu_proof uptrain --profile gpu --out OUT --work WORK   # `gqakit uptrain` tokens/s, MFU
    python -m bench.gpu_convert       --profile gpu --out OUT --work WORK   # streamed align-refit convert
    python -m bench.gpu_proof summary --profile gpu --out OUT               # OUT/gpu_proof.json + .md

Profile `gpu` is sized for one H100 in about nine minutes in all; profile `dry` runs the
same code paths with pico sizes on the CPU (the test suite runs it). Inputs are synthetic:
text from the docstrings and source of Python's standard library (never random bytes), a
byte-level BPE trained on it in seconds, and Llama-shaped models with transformers' own
random initialisation (not zeros). Speed and memory do not depend on what they say.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import LLAMA2_7B, LLAMA_1B, folder_bytes, random_llama, say, write_json
from bench.gpu_proof_md import count, step_md

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PICO = {"hidden": 64, "layers": 2, "heads": 8, "intermediate": 128, "vocab": 512}

PROFILES: dict[str, dict[str, Any]] = {
    "gpu": {
        # Text: 2.5 M characters (~590 k tokens of this BPE) cover the 410 k uptraining
        # tokens and the 131 k calibration tokens; the BPE trains on the first 1 M.
        "device": "cuda", "dtype": "bfloat16", "text_chars": 2_500_000,
        "tokenizer_vocab": 32000, "tokenizer_chars": 1_000_000,
        # 3 models (32, 8, 4 KV heads) are 12.6 + 11.1 + 10.8 GiB of bf16 weights. MHA at
        # batch 64 x (2,048 + 32) needs a 65 GiB cache: it reports "oom", which is itself
        # the point (the 8-KV-head cache is 16 GiB).
        # Eager decode of a 32-layer HF model is bound by kernel launches (tens of ms per
        # step) long before HBM is: steps are replayed as CUDA graphs (captured per grid
        # point, checked against eager, eager again if capture fails); torch.compile would
        # recompile for every batch and cache length, minutes the budget does not have.
        # MHA against GQA at 8 and 4 KV heads; the largest batch that fits at
        # 2,048 tokens is searched with the cache and one decode step (no prefill).
        "decode": {**LLAMA2_7B, "kv_heads": "8,4", "batch": "1,16,64", "prompt_len": "512,2048",
                   "new_tokens": 32, "reps": 3, "warmup": 1, "cuda_graphs": True, "max_batch_at": 2048},
        # The same models with the step compiled (`torch.compile(mode="reduce-overhead")`: inductor
        # fuses the norms, rotary and activation kernels, and the step replays as a CUDA graph, the
        # gpt-fast recipe). CUDA graphs of eager steps ran at 55% of copy bandwidth at batch 1 on an H100:
        # ~1,300 small kernels per step. Each grid point compiles once per model, so the grid is
        # two points, MHA against 8 KV heads (batch-1 bandwidth and speedup at batch 16).
        "decode-compiled": {**LLAMA2_7B, "kv_heads": "8", "batch": "1,16", "prompt_len": "2048",
                            "new_tokens": 32, "reps": 3, "warmup": 1, "compile": True},
        # 8,192 tokens per step keeps activations near 20 GiB next to 18 GiB of fp32
        # weights, gradients and AdamW state; 50 steps take well under a minute.
        "uptrain": {**LLAMA_1B, "kv_heads": 4, "seq_len": 2048, "micro_batch": 4, "steps": 50, "log_every": 10},
        "convert": {**LLAMA2_7B, "kv_heads": 8, "method": "align-refit", "calibration_tokens": 131_072},
    },
    "dry": {
        "device": "cpu", "dtype": "float32", "text_chars": 60_000, "tokenizer_vocab": 512, "tokenizer_chars": 60_000,
        "decode": {**PICO, "kv_heads": "2,1", "batch": "1,2", "prompt_len": "16,32", "new_tokens": 4,
                   "reps": 1, "warmup": 1, "cuda_graphs": True, "max_batch_at": 32},  # graphs: ignored on the CPU
        "decode-compiled": {**PICO, "kv_heads": "2", "batch": "1", "prompt_len": "16", "new_tokens": 4,
                            "reps": 1, "warmup": 1, "compile": True},
        "uptrain": {**PICO, "kv_heads": 2, "seq_len": 64, "micro_batch": 2, "steps": 6, "log_every": 2},
        "convert": {**PICO, "kv_heads": 2, "method": "align-refit", "calibration_tokens": 2048},
    },
}


def run_cli(argv: list[str]) -> None:
    """`gqakit ARGV` in this process (so its GPU memory is this process's); raises on failure."""
    from gqakit.cli import main

    try:
        main(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"`gqakit {' '.join(argv[:1])}` exited with {e.code} (its message is above)") from None


def run_facts(device: str) -> dict[str, Any]:
    import torch

    from gqakit.eval.provenance import run_info

    return run_info(command=sys.argv, device=device, dtype=torch.bfloat16).to_json()


# --------------------------------------------------------------------------- synthetic inputs


def proof_text(min_chars: int) -> str:
    """Standard-library docstrings (then stdlib source, if they run short): at least `min_chars`."""
    import sysconfig

    from gqakit.demo import training_texts

    texts = training_texts(limit_chars=min_chars)
    total = sum(len(t) for t in texts)
    if total < min_chars:
        root = Path(sysconfig.get_paths()["stdlib"])
        for f in sorted(root.glob("*.py")):
            if total >= min_chars:
                break
            try:
                src = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            texts.append(src)
            total += len(src)
    return "\n\n".join(texts)


def text_file(work: Path, p: dict[str, Any]) -> Path:
    """WORK/text.txt: the profile's `text_chars` of standard-library text, written once per run."""
    path = work / "text.txt"
    if not path.is_file() or path.stat().st_size < p["text_chars"]:
        t0 = time.time()
        path.write_text(proof_text(p["text_chars"]))
        say(f"text: {path.stat().st_size:,} bytes of standard-library docstrings in {time.time() - t0:.1f} s")
    return path


def tokenizer(work: Path, p: dict[str, Any]) -> Any:
    """A byte-level BPE with at most `tokenizer_vocab` entries (fewer if the text has fewer merges), trained once."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab, chars = p["tokenizer_vocab"], p["tokenizer_chars"]
    folder = work / f"tokenizer-{vocab}"
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t0 = time.time()
    text = text_file(work, p).read_text()[:chars]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(text.split("\n\n"), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(folder)
    say(f"tokenizer: byte-level BPE, {len(tok):,} entries, trained on {len(text):,} chars in {time.time() - t0:.1f} s")
    return tok


def build_llama(folder: Path, shape: dict[str, Any], kv_heads: int, *, device: str, dtype: str, tok: Any,
                positions: int = 4096) -> dict[str, Any]:
    """Save a random Llama-shaped model (initialised on `device`) with `tok`; returns its facts."""
    import torch

    t0 = time.time()
    model = random_llama(shape, kv_heads, device=device, dtype=dtype, positions=positions,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"path": str(folder), "parameters": params, "kv_heads": kv_heads, "dtype": dtype,
            "bytes_on_disk": folder_bytes(folder), "build_s": round(time.time() - t0, 2), **shape}


def meta_parameters(folder: Path) -> int:
    """Parameter count of a saved model, from its config alone (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- step 1: decode grid


def decode_argv(p: dict[str, Any], out: Path, step: str = "decode") -> list[str]:
    """bench/bench_decode.py's command line for the profile's grid of `step` (decode, decode-compiled)."""
    d = p[step]
    argv = ["--hidden", d["hidden"], "--layers", d["layers"], "--heads", d["heads"],
            "--kv-heads", d["kv_heads"], "--intermediate", d["intermediate"], "--vocab", d["vocab"],
            "--batch", d["batch"], "--prompt-len", d["prompt_len"], "--new-tokens", d["new_tokens"],
            "--reps", d["reps"], "--warmup", d["warmup"], "--device", p["device"], "--dtype", p["dtype"],
            "--out", out / f"{step.replace('-', '_')}.json", *(["--cuda-graphs"] if d.get("cuda_graphs") else []),
            *(["--compile"] if d.get("compile") else []),
            *(["--max-batch-at", d["max_batch_at"]] if d.get("max_batch_at") else [])]
    return [str(a) for a in argv]


def step_decode(p: dict[str, Any], out: Path, work: Path, step: str = "decode") -> None:
    """bench/bench_decode.py with the profile's grid; it rewrites OUT/<step>.json after every point."""
    sys.argv = ["bench_decode.py", *decode_argv(p, out, step)]
    from bench import bench_decode

    bench_decode.main()


# --------------------------------------------------------------------------- step 2: uptrain MFU


def steady(rows: list[dict[str, Any]], key: str) -> float | None:
    """Median of `key` over the logged rows after the first (which holds start-up and warm-up)."""
    vals = [r[key] for r in rows[1:] if key in r] or [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else None


def run_uptrain(cfg: dict[str, Any], cfg_path: Path, res: dict[str, Any]) -> list[dict[str, Any]]:
    """`gqakit uptrain` on `cfg` (written to `cfg_path`); records the config and the wall time
    in `res`, and returns the rows of the run's log.jsonl, also when the run fails."""
    import yaml

    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    res["config"] = cfg
    log = Path(cfg["output"]["dir"]) / "log.jsonl"
    t0 = time.time()
    try:
        run_cli(["uptrain", str(cfg_path), "--overwrite", "-q"])
    finally:
        res["uptrain_s"] = round(time.time() - t0, 2)
        res["log"] = [json.loads(r) for r in log.read_text().splitlines() if r.strip()] if log.is_file() else []
    return res["log"]


def uptrain_config(p: dict[str, Any], model: Path, text: Path, run_dir: Path) -> dict[str, Any]:
    """The `gqakit uptrain` config of the profile: plain text, no eval, no checkpoints."""
    u = p["uptrain"]
    return {
        "model": {"path": str(model)},
        "data": {"files": [str(text)], "sample_by": "paragraph", "cache_dir": str(run_dir.parent / "cache")},
        "train": {"tokens": u["seq_len"] * u["micro_batch"] * u["steps"], "seq_len": u["seq_len"],
                  "micro_batch": u["micro_batch"], "grad_accum": 1, "lr": 3e-4, "warmup_steps": 5,
                  "precision": "auto", "cpu": p["device"] == "cpu", "seed": 0},
        "eval": {"every": 0},
        "output": {"dir": str(run_dir), "save_every": 0},
        "logging": {"every": u["log_every"], "tensorboard": False},
    }


def step_uptrain(p: dict[str, Any], out: Path, work: Path) -> None:
    """Random 1B Llama (MHA) -> `gqakit convert` (mean) -> `gqakit uptrain` for some tens of steps."""
    import torch

    u, dev = p["uptrain"], p["device"]
    res: dict[str, Any] = {"status": "running", "phase": "setup", "profile": p["name"], "device": dev,
                           "settings": u, "run": run_facts(dev)}
    path = out / "uptrain.json"
    write_json(path, res)
    tokens_per_step = u["seq_len"] * u["micro_batch"]
    tok = tokenizer(work, p)
    train_txt = text_file(work, p)  # fewer tokens than the budget just means a second epoch

    res["phase"] = "build"
    write_json(path, res)
    mha = work / "uptrain-mha"
    res["source_model"] = build_llama(mha, u, u["heads"], device=dev, dtype=p["dtype"], tok=tok,
                                      positions=max(4096, u["seq_len"]))
    say(f"uptrain: built a {count(res['source_model']['parameters'])}-parameter MHA model in {res['source_model']['build_s']} s")

    res["phase"] = "convert"
    write_json(path, res)
    gqa = work / "uptrain-gqa"
    t0 = time.time()
    run_cli(["convert", str(mha), str(gqa), "-g", str(u["kv_heads"]), "--method", "mean", "--overwrite", "-q"])
    res["convert_s"] = round(time.time() - t0, 2)
    shutil.rmtree(mha, ignore_errors=True)

    res["phase"] = "uptrain"
    write_json(path, res)
    run_dir = work / "uptrain-run"
    cfg = uptrain_config(p, gqa, train_txt, run_dir)
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    try:
        run_uptrain(cfg, work / "uptrain.yaml", res)
    finally:
        train_rows = [r for r in res.get("log", []) if "tok_per_s" in r]
        from gqakit.uptrain.trainer import peak_flops

        peak = peak_flops(torch.device(dev)) if dev.startswith("cuda") else None
        res["result"] = {
            "parameters": meta_parameters(gqa) if (gqa / "config.json").is_file() else None,
            "tokens_per_step": tokens_per_step,
            "steps_logged": [r["step"] for r in train_rows],
            "tok_per_s_steady": steady(train_rows, "tok_per_s"),
            "mfu_steady": steady(train_rows, "mfu"),
            "peak_flops_per_device": peak,
            "flops_per_token_formula": "6 x parameters + 12 x layers x hidden x seq_len",
            "final_loss": train_rows[-1]["loss"] if train_rows else None,
            "peak_gpu_memory_allocated": int(torch.cuda.max_memory_allocated()) if dev.startswith("cuda") else None,
            # the memory plan the run logged first (`gqakit uptrain --dry-run` prints the same figure)
            "planned_peak_bytes": next((r["memory_plan"]["peak_bytes"] for r in res.get("log", [])
                                        if r.get("memory_plan")), None),
        }
        if r_ := res["result"]:
            measured, planned = r_["peak_gpu_memory_allocated"], r_["planned_peak_bytes"]
            r_["plan_error"] = round(planned / measured - 1, 4) if measured and planned else None
        write_json(path, res)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(gqa, ignore_errors=True)
    r = res["result"]
    res.update(status="ok", phase="done")
    write_json(path, res)
    say(f"uptrain: {r['tok_per_s_steady'] or 0:,.0f} tok/s steady"
        + (f", MFU {100 * r['mfu_steady']:.1f}%" if r["mfu_steady"] is not None else ", no MFU (no known peak FLOP/s)"))


# --------------------------------------------------------------------------- summary


STEPS = [("decode", "1. Decode grid (bench/bench_decode.py)"), ("uptrain", "2. Uptrain throughput and MFU"),
         ("convert", "3. Streamed calibrated conversion"), ("recover", "4. SmolLM2 G=1 recovery (bench/gpu_recover.py)"),
         ("decode-compiled", "5. Decode, compiled step (bench/bench_decode.py --compile)"),
         ("refit", "6. align-refit at its defaults, 7B shape (bench/gpu_refit.py)"),
         ("vllm", "7. vLLM: serving check and capacity, SmolLM2 G=3 vs G=1 (bench/gpu_vllm.py)")]


def _file(step: str) -> str:
    return f"{step.replace('-', '_')}.json"


def _read_steps(out: Path) -> dict[str, dict[str, Any]]:
    """OUT/steps.tsv, written by the shell script: step, exit code, seconds, time limit."""
    found: dict[str, dict[str, Any]] = {}
    f = out / "steps.tsv"
    for line in (f.read_text().splitlines() if f.is_file() else []):
        parts = line.split("\t")
        if len(parts) >= 4 and parts[1].lstrip("-").isdigit():
            found[parts[0]] = {"rc": int(parts[1]), "wall_s": float(parts[2]), "limit_s": float(parts[3])}
    return found


def _status(step: str, shell: dict[str, Any] | None, data: dict[str, Any] | None) -> str:
    if shell is None:
        return "not run"
    if shell["rc"] == -1:
        return "not run: no time left in the budget"
    if shell["rc"] == -2:
        return "skipped: not in GQAKIT_PROOF_STEPS"
    if shell["rc"] in (124, 137):
        return f"timed out after {shell['limit_s']:.0f} s" + (f" (in {data['phase']})" if data and data.get("phase") else "")
    if data is None:
        return f"failed (exit {shell['rc']}, no results; see log.txt)"
    st = str(data.get("status", "ok" if step.startswith("decode") and data.get("complete") else "?"))
    if shell["rc"] != 0 and not st.startswith("skipped"):
        return f"failed (exit {shell['rc']}" + (f", in {data['phase']}" if data.get("phase") else "") + "; see log.txt)"
    return st


def summary(profile: str, out: Path) -> dict[str, Any]:
    shell = _read_steps(out)
    commit = os.environ.get("GQAKIT_PROOF_COMMIT") or "unknown"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: dict[str, Any] = {"profile": profile, "commit": commit, "date": date, "steps": {}}
    md = [f"### GPU proof run: `bash bench/gpu_proof.sh{' --dry-run' if profile == 'dry' else ''} OUTDIR`", "",
          f"Commit {commit}, {date}; all steps in one process each, one after another, on one device.", ""]
    if profile == "dry":
        md += ["**Dry run: pico models on the CPU. These numbers only show that the script works; "
               "they are not measurements.**", ""]
    for step, title in STEPS:
        f = out / _file(step)
        try:
            data = json.loads(f.read_text()) if f.is_file() else None
        except json.JSONDecodeError:
            data = None
        status = _status(step, shell.get(step), data)
        results["steps"][step] = {"status": status, "shell": shell.get(step), "file": f.name if data else None}
        md += [f"#### {title}", "", f"Status: {status}" + (f"; {shell[step]['wall_s']:.0f} s of a {shell[step]['limit_s']:.0f} s limit"
                                                          if step in shell else "") + ".", ""]
        if data is None:
            continue
        try:
            md += step_md(step, data, results["steps"][step])
        except (KeyError, TypeError, ValueError) as e:  # a partial file: say so, keep the rest of the summary
            md += [f"(results file {f.name} is incomplete: {type(e).__name__}: {e})", ""]
    md.append("Raw numbers: gpu_proof.json, decode.json, uptrain.json, convert.json, decode_compiled.json; logs: log.txt.")
    results["markdown"] = "\n".join(md) + "\n"
    write_json(out / "gpu_proof.json", results)
    (out / "gpu_proof.md").write_text(results["markdown"])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["decode", "decode-compiled", "uptrain", "summary"])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="gpu")
    ap.add_argument("--out", type=Path, required=True, help="results folder (JSON, Markdown)")
    ap.add_argument("--work", type=Path, help="scratch folder for models and text (not for summary)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step == "summary":
        res = summary(args.profile, args.out)
        width = max(len(s) for s in res["steps"])
        for s, r in res["steps"].items():
            print(f"  {s:<{width}}  {r['status']}")
        return
    if args.work is None:
        ap.error("--work is needed for this step")
    args.work.mkdir(parents=True, exist_ok=True)
    p = {**PROFILES[args.profile], "name": args.profile}
    if args.step == "uptrain":
        step_uptrain(p, args.out, args.work)
    else:
        step_decode(p, args.out, args.work, args.step)


if __name__ == "__main__":
    main()
