"""Train a small multi-head T5 1.1 from scratch on the CPU: an encoder-decoder whose weights
have learned something, to convert and uptrain where no pretrained T5 can be downloaded.

    python -m bench.train_tiny_t5 [--out ~/.cache/gqakit/tiny-t5] [--steps 1000]

The text is TinyStories-style: stories sampled from stories260K (../shared/models), in its
own tokenizer, which the T5 shares with `<pad>` and 100 sentinel tokens added. The model is
T5 1.1 (gated GELU, untied head, no dropout): d_model 256, 8 heads of 32, 6 encoder and 6
decoder layers, d_ff 640. The objective is span corruption (`gqakit.core.spans`: noise
density 0.15, mean span 3), encoder inputs of 128 tokens, batch 32, AdamW with a warm-up and
a cosine decay. Everything is seeded and runs on one fixed number of threads with denormal
floats flushed to zero, so a rerun on the same machine gives the same weights. Held-out: the
span-corruption perplexity of the decoder targets on
`../shared/data/tinystories/valid-excerpt.txt`, before and after.

The folder (weights, config, tokenizer) is written atomically outside the repository; a
result row goes to `--results` (bench/results/train_tiny_t5.jsonl).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from bench.common import RESULTS, SHARED, append_jsonl, say
from gqakit.core.outdir import atomic_output_dir
from gqakit.core.spans import SpanCorruption, sentinel_ids
from gqakit.core.tokens import sample_tokens

STORIES = SHARED / "models" / "stories260K"
HELD_OUT = SHARED / "data" / "tinystories" / "valid-excerpt.txt"
INPUT_LEN = 128


def tokenizer_with_sentinels():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    tok.add_special_tokens({"pad_token": "<pad>",
                            "additional_special_tokens": [f"<extra_id_{i}>" for i in range(100)]})
    return tok


def sampled_ids(num: int, length: int, seed: int) -> list[int]:
    """`num` stories of `length` tokens from stories260K, joined by EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    eos = model.config.eos_token_id
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for start in range(0, num, 512):
        batch = sample_tokens(model, [1], min(512, num - start), length, generator=gen, never=[eos])
        for row in batch.tolist():
            ids += row + [eos]
    return ids


def examples(ids: list[int], sc: SpanCorruption, sentinels: list[int], eos: int, seed: int):
    """(input, target) pairs of consecutive chunks, each corrupted by its index."""
    n = sc.source_length(INPUT_LEN) - 1  # the input's EOS is added by `corrupt`
    chunks = [ids[i:i + n] for i in range(0, len(ids) - n + 1, n)]
    return [sc.corrupt(c, sentinels, seed=seed, index=i, eos_id=eos) for i, c in enumerate(chunks)]


def collate(pairs, pad: int):
    li, lt = max(len(p[0]) for p in pairs), max(len(p[1]) for p in pairs)
    inp = torch.full((len(pairs), li), pad)
    lab = torch.full((len(pairs), lt), -100)
    for r, (i, t) in enumerate(pairs):
        inp[r, :len(i)] = torch.tensor(i)
        lab[r, :len(t)] = torch.tensor(t)
    return inp, (inp != pad).long(), lab


@torch.no_grad()
def target_perplexity(model, pairs, pad: int, batch: int = 32) -> float:
    model.eval()
    nll, count = 0.0, 0
    for s in range(0, len(pairs), batch):
        inp, mask, lab = collate(pairs[s:s + batch], pad)
        logits = model(input_ids=inp, attention_mask=mask, labels=lab).logits
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum").item()
        count += int((lab != -100).sum())
    model.train()
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path.home() / ".cache/gqakit/tiny-t5")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--stories", type=int, default=8192, help="sampled stories of 256 tokens")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--results", type=Path, default=RESULTS / "train_tiny_t5.jsonl")
    args = ap.parse_args()
    # Denormal floats flushed to zero, set before the first parallel op so that every thread of
    # the pool inherits it: as the weights train, products underflow into denormals, which these
    # CPUs compute at a fraction of the speed (without it, a step on the trained weights takes
    # about twice as long).
    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    from transformers import T5Config, T5ForConditionalGeneration

    t0 = time.perf_counter()
    tok = tokenizer_with_sentinels()
    sentinels, pad, eos = sentinel_ids(tok), tok.pad_token_id, tok.eos_token_id
    sc = SpanCorruption()
    say(f"sampling {args.stories} stories from stories260K")
    train = examples(sampled_ids(args.stories, 256, args.seed), sc, sentinels, eos, args.seed)
    held_ids = [i for line in HELD_OUT.read_text().split("\n\n") if line.strip()
                for i in [1, *tok(line.strip(), add_special_tokens=False).input_ids, eos]]
    held = examples(held_ids, sc, sentinels, eos, seed=1234)
    say(f"{len(train)} training examples, {len(held)} held-out, {time.perf_counter() - t0:.0f} s")

    torch.manual_seed(args.seed)
    cfg = T5Config(vocab_size=-(-len(tok) // 8) * 8, d_model=args.d_model, d_kv=args.d_model // 8,
                   num_heads=8, d_ff=int(args.d_model * 2.5), num_layers=args.layers,
                   num_decoder_layers=args.layers, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                   dropout_rate=0.0, pad_token_id=pad, eos_token_id=eos, decoder_start_token_id=pad)
    model = T5ForConditionalGeneration(cfg)
    before = target_perplexity(model, held, pad)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(args.steps // 20, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, 0.1 + 0.45 * (
        1 + math.cos(math.pi * min(max(s - warm, 0) / max(args.steps - warm, 1), 1.0)))))
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed)).tolist()
    say(f"training {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters for {args.steps} steps; "
        f"held-out perplexity before {before:.1f}")
    t1 = time.perf_counter()
    for step in range(args.steps):
        idx = [order[(step * args.batch + j) % len(order)] for j in range(args.batch)]
        inp, mask, lab = collate([train[i] for i in idx], pad)
        loss = model(input_ids=inp, attention_mask=mask, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            say(f"step {step}: loss {loss.item():.3f}, {(time.perf_counter() - t1) / (step + 1):.2f} s/step")
    after = target_perplexity(model, held, pad)
    with atomic_output_dir(args.out, overwrite=args.overwrite) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    row = {"script": "train_tiny_t5", "date": time.strftime("%Y-%m-%d"), "out": str(args.out),
           "params": sum(p.numel() for p in model.parameters()), "steps": args.steps, "batch": args.batch,
           "lr": args.lr, "d_model": args.d_model, "layers": args.layers, "threads": args.threads,
           "train_examples": len(train), "held_out_examples": len(held), "held_out_ppl_before": round(before, 3),
           "held_out_ppl_after": round(after, 3), "seconds": round(time.perf_counter() - t0, 1)}
    append_jsonl(args.results, row)
    say(f"held-out span-corruption perplexity {before:.1f} -> {after:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
