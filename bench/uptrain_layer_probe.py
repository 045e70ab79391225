"""How close can uptraining get? A per-layer capacity probe on stories260K (docs/benchmarks.md).

The original model with ONE layer's attention mean-pooled to G KV heads, every other
layer left original. Only that attention (or, with --train all, every weight) is trained,
by KL to the original's logits, on the same teacher-sampled text as
configs/stories260K-g2.yaml (the cached samples are shared). The whole token budget goes
to that one layer, so its held-out perplexity is a floor for what the same budget can do
when all layers are converted: their damages add up.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.uptrain_layer_probe --layer 2 --tokens 2000000
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.uptrain_layer_probe --layer 2 --tokens 2000000 --train all --lr 3e-3
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.uptrain_layer_probe --layer 2 --tokens 6000000

Perplexity: ../shared/data/tinystories/valid-excerpt.txt, gqakit.eval.perplexity (context
512, stride 512, BOS prepended), fp32 on CPU. Schedule as the recipe: AdamW (0.9, 0.95),
20 warm-up steps, cosine to 5%, clip 1.0, 2 x 512 tokens per step. Results are appended
as JSON lines to bench/results/uptrain_layer_probe.jsonl.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_methods import MODELS
from bench.common import REPO, RESULTS, append_jsonl

RECIPE = REPO / "configs" / "stories260K-g2.yaml"
SEQ, MICRO, WARMUP, MIN_LR = 512, 2, 20, 0.05


def training_blocks(tok, teacher: Path) -> torch.Tensor:
    """The recipe's teacher samples (cached by gqakit), one BOS per story, packed into 512-token rows."""
    from gqakit.uptrain.config import load_config
    from gqakit.uptrain.data import default_cache_dir, teacher_samples_file

    cfg = load_config(RECIPE, [f"model.path={teacher}", f"teacher.path={teacher}"])  # only data is read
    f = teacher_samples_file(cfg.data.teacher_samples, teacher, default_cache_dir(cfg.data))
    ids: list[int] = []
    for line in f.read_text().splitlines():
        ids += [tok.bos_token_id or 1] + tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[: len(ids) // SEQ * SEQ]).view(-1, SEQ)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", type=int, required=True)
    ap.add_argument("--g", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--train", choices=["attention", "all"], default="attention")
    ap.add_argument("--evals", type=int, default=4, help="held-out evaluations along the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "uptrain_layer_probe.jsonl"))
    args = ap.parse_args()
    from gqakit.convert.pipeline import convert_checkpoint
    from gqakit.core.loading import load_causal_lm, load_tokenizer

    m = MODELS["stories"]
    torch.manual_seed(args.seed)
    teacher = load_causal_lm(m["src"]).eval()
    teacher.requires_grad_(False)
    tok = load_tokenizer(m["src"])
    with tempfile.TemporaryDirectory() as tmp:
        pooled = load_causal_lm(convert_checkpoint(m["src"], Path(tmp) / "g", args.g, "mean", progress=False))
    model = copy.deepcopy(teacher)
    model.model.layers[args.layer].self_attn = pooled.model.layers[args.layer].self_attn
    model.requires_grad_(args.train == "all")
    model.model.layers[args.layer].self_attn.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]

    from gqakit.core.text import read_text
    from gqakit.eval.perplexity import Window, evaluate_perplexity

    text = read_text(str(m["data"]))

    def perplexity(net) -> float:
        return evaluate_perplexity(net, tok, text, Window(context=SEQ, stride=SEQ), progress=False).token_perplexity

    def ppl() -> float:
        return perplexity(model)

    original, start = perplexity(teacher), ppl()
    print(f"original {original:.3f}; layer {args.layer} pooled to {args.g} KV heads, untrained: {start:.3f}", flush=True)
    blocks = training_blocks(tok, m["src"])
    blocks = blocks[torch.randperm(len(blocks))]
    steps = args.tokens // (MICRO * SEQ)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    evals = {round(steps * k / args.evals) for k in range(1, args.evals + 1)}
    curve, t0 = [], time.perf_counter()
    for s in range(steps):
        lr = (args.lr * (s + 1) / (WARMUP + 1) if s < WARMUP else
              args.lr * (MIN_LR + (1 - MIN_LR) * 0.5 * (1 + math.cos(math.pi * s / steps))))
        for g in opt.param_groups:
            g["lr"] = lr
        i = (MICRO * s) % len(blocks)  # epochs repeat the same shuffled order
        x = blocks[i: i + MICRO]
        with torch.no_grad():
            log_p_t = F.log_softmax(teacher(input_ids=x).logits.float(), -1)
        log_p_s = F.log_softmax(model(input_ids=x).logits.float(), -1)
        kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        kl.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if s + 1 in evals:
            point = {"tokens": (s + 1) * MICRO * SEQ, "ppl": round(ppl(), 4), "seconds": round(time.perf_counter() - t0)}
            curve.append(point)
            print(point, flush=True)
    row = {"layer": args.layer, "G": args.g, "train": args.train, "trained_params": sum(p.numel() for p in params),
           "lr": args.lr, "tokens": steps * MICRO * SEQ, "original": round(original, 4), "untrained": round(start, 4),
           "final": curve[-1]["ppl"], "vs_original": round(curve[-1]["ppl"] / original - 1, 4), "curve": curve,
           "device": f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s), torch {torch.__version__}, fp32"}
    print(json.dumps(row), flush=True)
    append_jsonl(args.out, row)


if __name__ == "__main__":
    sys.exit(main())
