"""SmolLM2-135M at 1 KV head, uptrained on a GPU from gqakit's best start until it is
within 10% of the original's perplexity.

    python -m bench.gpu_recover --source ~/.cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --out OUT [--tokens 50000000] [--eval-every-tokens 1000000]
    python -m bench.gpu_recover --dry --out OUT      # pico model on the CPU: the same code path (tests)

1. the original's perplexity (gqakit.eval.perplexity: first 300,000 characters of
   WikiText-2 raw test, context 512, stride 512, BOS prepended: the method table's protocol);
2. `gqakit convert -g 1 --method align-refit` with the recommended reconstruction
   (32,768 tokens of WikiText-2 valid, steps=400, lr=0.01) on the GPU: wall time and the
   start's perplexity;
3. `gqakit uptrain` of the attention on text sampled from the original (teacher samples),
   distilling its logits (KL), with held-out perplexity every `--eval-every-tokens`;
4. the final model's perplexity by the same protocol as 1 and 2.

OUT/recover.json: every number, the uptrain log (loss curve, tokens/s, MFU), perplexity
per million tokens and the first point within 10% of the original; OUT/recover.png: the
curves. The curve's perplexities are uptrain's held-out evaluation (packed 512-token
blocks of the same text, no BOS), close to but not the protocol's; the start and final
numbers are the protocol's. Needs the SmolLM2 GGUF (98 MB: `gqakit demo` caches it, or
see ../shared/README.md) and ../shared's WikiText-2 beside the checkout, so
`bench/gpu_proof.sh` runs this step only when GQAKIT_SMOLLM2 names the GGUF.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import SHARED, SMOLLM2, perplexity, say, write_json
from bench.gpu_proof import PICO, build_llama, proof_text, run_cli, run_facts, run_uptrain, steady, tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EVAL_CHARS = 300_000


def within(curve: list[dict[str, Any]], target: float) -> int | None:
    """Tokens at the first evaluation at or under `target`, or None."""
    return next((r["tokens"] for r in curve if r["eval_ppl"] <= target), None)


def plot(path: Path, res: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    tr = res["loss_curve"]
    a.plot([r["tokens"] / 1e6 for r in tr], [r["loss"] for r in tr])
    a.set(xlabel="tokens (millions)", ylabel="training loss", title="uptraining loss")
    ev = res["ppl_curve"]
    b.plot([r["tokens"] / 1e6 for r in ev], [r["eval_ppl"] for r in ev], marker="o", label="converted, uptrained")
    b.axhline(res["ppl"]["original"], color="k", ls="--", label="original")
    b.axhline(1.1 * res["ppl"]["original"], color="g", ls=":", label="original + 10%")
    b.set(xlabel="tokens (millions)", ylabel="held-out perplexity", yscale="log", title="recovery")
    b.legend()
    fig.suptitle(res["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=SMOLLM2)
    ap.add_argument("--shared", type=Path, default=SHARED)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder, kept (default: a new folder in OUT, removed at the end)")
    ap.add_argument("--tokens", type=int, default=50_000_000, help="uptraining budget")
    ap.add_argument("--eval-every-tokens", type=int, default=1_000_000)
    ap.add_argument("--sample-tokens", type=int, default=8_000_000, help="teacher samples (reused each epoch)")
    ap.add_argument("--dry", action="store_true", help="a pico random model on the CPU, tiny budgets")
    args = ap.parse_args()
    import torch

    # gpu_proof.sh runs this under `timeout`: its SIGTERM becomes an exception, so the
    # `finally` blocks below still write the curves measured so far to recover.json
    def stop(signum: int, frame: object) -> None:
        raise TimeoutError("stopped by SIGTERM (the step's time limit)")

    signal.signal(signal.SIGTERM, stop)

    dry = args.dry
    dev = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        sys.exit("gpu_recover.py: no CUDA device (use --dry for the CPU code path)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # scratch: --work as given (kept), else a new folder of our own in OUT (removed at the end);
    # never an existing folder of the user's that we would then delete
    work = args.work.resolve() if args.work else Path(tempfile.mkdtemp(prefix=".gpu_recover-", dir=out))
    work.mkdir(parents=True, exist_ok=True)
    path = out / "recover.json"
    res: dict[str, Any] = {"status": "running", "phase": "setup", "dry": dry, "device": dev, "run": run_facts(dev)}
    write_json(path, res)
    if dry:  # a random pico model and standard-library text: the plumbing, not the numbers
        p = {"text_chars": 60_000, "tokenizer_vocab": 512, "tokenizer_chars": 60_000}
        tok = tokenizer(work, p)
        src = work / "pico-mha"
        build_llama(src, PICO, PICO["heads"], device="cpu", dtype="float32", tok=tok, positions=1024)
        text = proof_text(60_000)
        calib, eval_text = work / "calib.txt", text[40_000:]
        calib.write_text(text[:40_000])
        seq_len, micro, accum = 64, 4, 1
        budget, every, samples, calib_tokens, steps = 4096, 1024, 4096, 1024, 4
    else:
        src = args.source
        for need in (src, args.shared / "data/wikitext-2/valid.txt", args.shared / "data/wikitext-2-raw/wiki.test.raw"):
            if not need.exists():
                sys.exit(f"gpu_recover.py: {need} not found (--source / --shared)")
        calib = args.shared / "data/wikitext-2/valid.txt"
        eval_text = (args.shared / "data/wikitext-2-raw/wiki.test.raw").read_text()[:EVAL_CHARS]
        seq_len, micro, accum = 512, 32, 2  # 32,768 tokens per optimizer step
        budget, every, samples, calib_tokens, steps = (args.tokens, args.eval_every_tokens, args.sample_tokens,
                                                       32_768, 400)
    eval_file = work / "eval.txt"
    eval_file.write_text(eval_text)
    res["title"] = (f"{src.name} 3→1 KV heads" if not dry else "pico random model (dry run)") + \
        f", {dev}, budget {budget:,} tokens"

    res["phase"] = "original"
    write_json(path, res)
    res["ppl"] = {"original": perplexity(src, eval_file, device=dev)}
    say(f"recover: original perplexity {res['ppl']['original']:.2f}")

    res["phase"] = "convert"
    write_json(path, res)
    g1 = work / "g1"
    t0 = time.time()
    run_cli(["convert", str(src), str(g1), "-g", "1", "--method", "align-refit", "--calibration-data", str(calib),
             "--calibration-tokens", str(calib_tokens), "--refit-option", f"steps={steps}",
             "--refit-option", "lr=0.01", "--device", dev, "--overwrite", "-q"])
    res["convert"] = {"seconds": round(time.time() - t0, 1), "calibration_tokens": calib_tokens, "steps": steps,
                      "lr": 0.01}
    res["ppl"]["start"] = perplexity(g1, eval_file, device=dev)
    say(f"recover: converted in {res['convert']['seconds']} s, perplexity {res['ppl']['start']:.2f}")

    res["phase"] = "uptrain"
    write_json(path, res)
    tokens_per_step = seq_len * micro * accum
    run_dir = work / "run"
    cfg = {
        "model": {"path": str(g1)},
        "teacher": {"path": str(src), "kl_weight": 1.0, "lm_weight": 0.0, "temperature": 1.0},
        "data": {"teacher_samples": {"num": max(1, samples // seq_len), "length": seq_len, "temperature": 1.0,
                                     "batch_size": 256 if not dry else 16, "seed": 1234},
                 "eval_file": str(eval_file), "cache_dir": str(work / "cache")},
        "train": {"tokens": budget, "seq_len": seq_len, "micro_batch": micro, "grad_accum": accum, "lr": 1e-3,
                  "trainable": ["self_attn"], "warmup_steps": 20, "min_lr_ratio": 0.1, "precision": "auto",
                  "cpu": dry, "seed": 0},
        "eval": {"every": max(1, every // tokens_per_step)},
        "output": {"dir": str(run_dir), "save_every": 0},
        "logging": {"every": 5 if not dry else 1, "tensorboard": False},
    }
    try:
        run_uptrain(cfg, work / "recover.yaml", res)
    except BaseException as e:  # stopped (the time limit) or failed: the curves so far still count
        res["status"] = f"stopped during uptrain: {type(e).__name__}: {e}"[:300]
        raise
    finally:
        rows = res.pop("log", [])
        train = [r for r in rows if "tok_per_s" in r]
        res["loss_curve"] = [{"tokens": r["tokens"], "loss": r["loss"]} for r in train]
        res["ppl_curve"] = [{"tokens": r["tokens"], "eval_ppl": r["eval_ppl"]} for r in rows if "eval_ppl" in r]
        res["throughput"] = {"tok_per_s_median": steady(train, "tok_per_s"), "mfu_median": steady(train, "mfu"),
                             "tokens_per_step": tokens_per_step}
        write_json(path, res)
    final = run_dir / "model"
    res["ppl"]["final"] = perplexity(final, eval_file, device=dev)
    target = 1.1 * res["ppl"]["original"]
    res["within_10_percent"] = {"target_ppl": target, "final_met": res["ppl"]["final"] <= target,
                                "first_curve_tokens": within(res["ppl_curve"], target),
                                "curve_protocol": "uptrain held-out eval (packed blocks, no BOS)"}
    plot(out / "recover.png", res)
    res.update(status="ok", phase="done")
    write_json(path, res)
    say(f"recover: final perplexity {res['ppl']['final']:.2f} (original {res['ppl']['original']:.2f}, "
        f"start {res['ppl']['start']:.2f}) after {budget:,} tokens; "
        f"{res['throughput']['tok_per_s_median'] or 0:,.0f} tok/s")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
