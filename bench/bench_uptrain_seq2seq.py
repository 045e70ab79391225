"""Uptraining recovery of an encoder-decoder: each training-free start, uptrained with T5's own
span corruption for the same token budget, scored before and after; one run killed and resumed.

    python -m bench.bench_uptrain_seq2seq [--model ~/.cache/gqakit/tiny-t5] [--g 1] [--methods mean align]

The model is the small T5 1.1 `python -m bench.train_tiny_t5` trains (8 heads). For each
method, `gqakit convert` groups the decoder's self- and cross-attention to G KV heads, and
`gqakit uptrain` trains every weight for `--tokens` tokens with span corruption (noise density
0.15, mean span 3; encoder inputs of 128 tokens, 16 per step, lr 1e-3 with 10 warm-up steps and
a cosine decay) on stories sampled from stories260K with their own seed (`--text-seed`, not
the tiny T5's training text, never the evaluation text). `gqakit eval` scores the decoder
targets' span-corruption perplexity on `../shared/data/tinystories/valid-excerpt.txt`
(inputs of 128 tokens, `--span-seed 0`), before and after, as `bench.bench_methods_seq2seq` does.

The first method's run is then repeated, killed with SIGKILL once its second checkpoint is on
disk, and resumed with `--resume`: the row records whether its losses and final weights equal
the uninterrupted run's to the bit (`--no-kill` skips it).

Everything is written under `--workdir` (default: a temporary folder, removed at the end); a
reused workdir keeps its sampled text, conversions and scores, and each recipe (method, G, lr,
tokens) trains into a folder of its own, so an existing run is never written over (`gqakit
uptrain` refuses to). Rows go to bench/results/uptrain_seq2seq.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import RESULTS, SHARED, append_jsonl, say

HELD_OUT = SHARED / "data" / "tinystories" / "valid-excerpt.txt"


def gqakit(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "gqakit", *args, "-q"], check=True, env=env)


def perplexity(model: Path, out: Path, context: int, env: dict[str, str]) -> float:
    """The held-out perplexity of `model`, read from `out` when an earlier run in the same
    --workdir already wrote it."""
    if not out.is_file():
        gqakit("eval", str(model), "--data", str(HELD_OUT), "--context", str(context), "--span-seed", "0",
               "--out", str(out), env=env)
    return float(json.loads(out.read_text())["perplexity"]["token_perplexity"])


def write_text(path: Path, stories: int, seed: int) -> None:
    """`stories` stories of 256 tokens sampled from stories260K, one paragraph each."""
    from bench.train_tiny_t5 import STORIES, sampled_ids

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    ids = sampled_ids(stories, 256, seed)
    eos = tok.eos_token_id
    docs, cur = [], []
    for i in ids:
        if i == eos:
            docs.append(tok.decode(cur, skip_special_tokens=True).strip())
            cur = []
        else:
            cur.append(i)
    path.write_text("\n\n".join(d.replace("\n\n", "\n") for d in docs if d) + "\n")


def config(model: Path, text: Path, out: Path, args: argparse.Namespace) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"files": [str(text)], "objective": "span_corruption"},
        "train": {"tokens": args.tokens, "seq_len": args.context, "micro_batch": 16, "grad_accum": 1,
                  "lr": args.lr, "warmup_steps": 10, "precision": "fp32", "cpu": True, "seed": 0},
        "output": {"dir": str(out), "save_every": args.save_every, "keep_last": 2},
        "logging": {"every": 10, "tensorboard": False},
    }


def write_config(path: Path, tree: dict) -> Path:
    """The recipe's YAML at `path`; an existing file is kept when it says the same, else refused."""
    text = yaml.safe_dump(tree)
    if path.exists() and (not path.is_file() or path.read_text() != text):
        sys.exit(f"bench_uptrain_seq2seq: {path} exists and holds something else; use another --workdir")
    path.write_text(text)
    return path


def losses(run: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (run / "log.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def killed_and_resumed(cfg: Path, run: Path, env: dict[str, str]) -> int:
    """Start the run, SIGKILL it once its second checkpoint is on disk, resume it; the last step logged before the kill."""
    proc = subprocess.Popen([sys.executable, "-m", "gqakit", "uptrain", str(cfg), "-q"], env=env)
    ckpts = run / "checkpoints"
    while proc.poll() is None and len(list(ckpts.glob("step-*"))) < 2:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit("bench_uptrain_seq2seq: the run finished before it could be killed; lower --save-every")
    killed_at = max(s for s, _ in losses(run))
    gqakit("uptrain", str(cfg), "--resume", env=env)
    return killed_at


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    wa = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(f).items()}
    wb = {k: v for f in sorted(b.glob("*.safetensors")) for k, v in load_file(f).items()}
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/gqakit/tiny-t5")
    ap.add_argument("--g", type=int, nargs="+", default=[1])
    ap.add_argument("--methods", nargs="+", default=["mean", "align"])
    ap.add_argument("--tokens", type=int, default=300_000, help="uptraining budget per start")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--context", type=int, default=128, help="encoder input length, in training and evaluation")
    ap.add_argument("--stories", type=int, default=1024, help="sampled stories of 256 tokens to train on")
    ap.add_argument("--text-seed", type=int, default=7)
    ap.add_argument("--save-every", type=int, default=40)
    ap.add_argument("--no-kill", action="store_true", help="skip the killed-and-resumed repeat")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "uptrain_seq2seq.jsonl")
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        sys.exit(f"bench_uptrain_seq2seq: no model at {args.model}; run `python -m bench.train_tiny_t5` first")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        text = work / "stories.txt"
        if not text.is_file():
            say(f"sampling {args.stories} stories (seed {args.text_seed}) to train on")
            write_text(text, args.stories, args.text_seed)
        base = {"script": "bench_uptrain_seq2seq", "date": time.strftime("%Y-%m-%d"), "model": str(args.model),
                "data": HELD_OUT.name, "context": args.context, "span_seed": 0, "tokens": args.tokens,
                "lr": args.lr, "threads": args.threads, "text_seed": args.text_seed, "stories": args.stories}
        original = perplexity(args.model, work / "original.json", args.context, env)
        say(f"original: {original:.3f}")
        for g in args.g:
            for n, method in enumerate(args.methods):
                conv = work / f"{method}-g{g}"
                if not (conv / "config.json").is_file():
                    gqakit("convert", str(args.model), str(conv), "-g", str(g), "--method", method, env=env)
                before = perplexity(conv, work / f"{method}-g{g}.json", args.context, env)
                tag = f"{method}-g{g}-lr{args.lr:g}-{args.tokens}"  # a run of its own per recipe
                run = work / f"run-{tag}"
                cfg = work / f"{tag}.yaml"
                write_config(cfg, config(conv, text, run, args))
                t0 = time.perf_counter()
                gqakit("uptrain", str(cfg), env=env)
                secs = time.perf_counter() - t0
                after = perplexity(run / "model", work / f"{tag}-after.json", args.context, env)
                steps = max(s for s, _ in losses(run))
                say(f"G={g} {method}: {before:.2f} -> {after:.2f} ({steps} steps, {secs:.0f} s)")
                row = {**base, "G": g, "method": method, "original_ppl": round(original, 3),
                       "ppl_before": round(before, 3), "ppl_after": round(after, 3), "steps": steps,
                       "uptrain_seconds": round(secs, 1), "loadavg": os.getloadavg()}
                if n == 0 and not args.no_kill:
                    kcfg = work / f"{tag}-killed.yaml"
                    krun = work / f"run-{tag}-killed"
                    write_config(kcfg, config(conv, text, krun, args))
                    killed_at = killed_and_resumed(kcfg, krun, env)
                    exact = losses(krun) == losses(run) and same_weights(krun / "model", run / "model")
                    say(f"killed after step {killed_at}, resumed: {'bit-exact' if exact else 'DIFFERENT'}")
                    row.update(killed_after_step=killed_at, resume_bit_exact=exact)
                append_jsonl(args.out, row)


if __name__ == "__main__":
    main()
