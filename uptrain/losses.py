"""The training objective: the loss terms of one micro-batch, written once.

`token_losses` computes every term as a sum over the predicted tokens; `LOSS_TERMS` says,
for each, its weight in the `teacher` config section, its key in log.jsonl and its line
on the model card, so `objective`, `loss_log` and `loss_card` cannot disagree.
`seq2seq_losses` is the same for an encoder-decoder: the target tokens' CE and the KL of
the decoder's logits (`batch_losses` picks by the micro-batch's kind), and `evaluate` the
held-out loss of either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from gqakit.core.loaded import decoder_blocks
from gqakit.uptrain.config import UptrainConfig
from gqakit.uptrain.seq2seq import IGNORE, Seq2SeqBatch


class Losses(NamedTuple):
    """Per-token sums over one micro-batch (see `token_losses`)."""
    ce: torch.Tensor
    kl: torch.Tensor
    hidden: torch.Tensor
    layer: torch.Tensor
    n: int


class LossTerm(NamedTuple):
    """One term of the training objective, written once: its `Losses` field, its weight in
    the `teacher` config section, its key in log.jsonl and its line on the model card.
    `log_when` / `card_when`: when it is logged / carded: "always", "never", "teacher"
    (whenever a teacher runs) or "weighted" (when its own weight is > 0)."""
    field: str
    weight: str
    log_key: str
    log_when: str
    card: str | None
    card_when: str


LOSS_TERMS = (
    LossTerm("ce", "lm_weight", "loss", "always", None, "never"),
    LossTerm("kl", "kl_weight", "kl", "teacher", "teacher KL weight", "always"),
    LossTerm("hidden", "hidden_weight", "hidden_mse", "weighted", "teacher hidden-state weight", "weighted"),
    LossTerm("layer", "layer_weight", "layer_mse", "weighted", "teacher layer-local weight", "weighted"),
)


def _shown(when: str, term: LossTerm, cfg: UptrainConfig, teacher: bool) -> bool:
    return when == "always" or when == "teacher" and teacher or when == "weighted" and getattr(cfg.teacher, term.weight) > 0


def objective(ls: Losses, cfg: UptrainConfig) -> torch.Tensor:
    """The weighted sum of the loss terms that is minimised."""
    return sum((getattr(cfg.teacher, t.weight) * getattr(ls, t.field) for t in LOSS_TERMS), 0)


def loss_log(means: Mapping[str, float], cfg: UptrainConfig, teacher: bool) -> dict[str, float]:
    """The loss terms of one optimizer step, as log.jsonl keys."""
    return {t.log_key: means[t.field] for t in LOSS_TERMS if _shown(t.log_when, t, cfg, teacher)}


def loss_card(cfg: UptrainConfig, teacher: bool) -> dict[str, float]:
    """The loss-term weights, as model-card lines."""
    return {t.card: getattr(cfg.teacher, t.weight) for t in LOSS_TERMS if t.card and _shown(t.card_when, t, cfg, teacher)}


@contextmanager
def layer_hooks(layers: torch.nn.ModuleList, record: list | None = None, feed: Sequence[torch.Tensor] | None = None):
    """While active, `record` gets (input, output) hidden states of every layer in order,
    and with `feed`, layer i runs on feed[i] instead of what the layer below passed up."""
    handles = []

    def pre(i: int):
        def hook(mod, args, kwargs):
            if args:
                return (feed[i], *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": feed[i]}
        return hook

    def post(mod, args, kwargs, output):
        inp = args[0] if args else kwargs["hidden_states"]
        record.append((inp, output[0] if isinstance(output, tuple) else output))

    try:
        for i, layer in enumerate(layers):
            if feed is not None:
                handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
            if record is not None:
                handles.append(layer.register_forward_hook(post, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def _sq_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum over predicted positions ([:, :-1], like the logits) of the mean squared error over hidden units."""
    return (a[:, :-1].float() - b[:, :-1].float()).pow(2).mean(-1).sum()


def kl_sum(logits: torch.Tensor, t_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the softened distributions, summed over positions."""
    log_p_s = F.log_softmax(logits / temperature, dim=-1)
    log_p_t = F.log_softmax(t_logits / temperature, dim=-1)
    # T^2 keeps the gradient scale independent of the temperature (Hinton et al.).
    return (log_p_t.exp() * (log_p_t - log_p_s)).sum() * temperature**2


def token_losses(model: Any, x: torch.Tensor, teacher: Any | None, temperature: float,
                 hidden: bool = False, layer: bool = False) -> Losses:
    """Sums over the predicted tokens of one micro-batch: next-token CE, KL(teacher||student),
    hidden-state MSE and layer-local MSE, and the number of predicted tokens.

    Sums, not means: the caller divides by the token count of the whole optimizer step
    across accumulation steps and processes, so the loss is a true per-token mean.
    - hidden (`hidden=True`): the student's residual stream after every layer against the
      teacher's, both running freely; per token the mean over hidden units of the squared
      difference, summed over layers. The embeddings are left out: conversion does not
      change them.
    - layer (`layer=True`): teacher-forced and layer-local. A second student pass feeds
      every layer the teacher's input to that layer, and the layer's output is compared
      with the teacher's output of it. Each layer then gets its own clean target, not one
      blurred by the errors of the layers below.
    """
    out = model(input_ids=x, output_hidden_states=hidden)
    logits = out.logits[:, :-1].float()
    target = x[:, 1:]
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")
    zero = torch.zeros((), device=x.device)
    kl, mse, local = zero, zero, zero
    if teacher is not None:
        t_io: list = []
        recording = layer_hooks(decoder_blocks(teacher), record=t_io) if layer else nullcontext()
        with torch.no_grad(), recording:
            t_out = teacher(input_ids=x, output_hidden_states=hidden)
            t_logits = t_out.logits[:, :-1].float()
        kl = kl_sum(logits, t_logits, temperature)
        if hidden:
            mse = sum((_sq_err(h_s, h_t) for h_s, h_t in zip(out.hidden_states[1:], t_out.hidden_states[1:])), zero)
        if layer:
            s_io: list = []
            with layer_hooks(decoder_blocks(model), record=s_io, feed=[i for i, _ in t_io]):
                model(input_ids=x)
            local = sum((_sq_err(o_s, o_t) for (_, o_s), (_, o_t) in zip(s_io, t_io)), zero)
    return Losses(ce, kl, mse, local, target.numel())


def seq2seq_losses(model: Any, b: Seq2SeqBatch, teacher: Any | None, temperature: float) -> Losses:
    """`token_losses` of an encoder-decoder: CE of the target tokens given the input, and
    KL(teacher || student) of the decoder's logits at the same positions (sums)."""
    logits = model(**b.inputs()).logits.float()
    keep = b.labels != IGNORE
    logits = logits[keep]
    ce = F.cross_entropy(logits, b.labels[keep], reduction="sum")
    zero = torch.zeros((), device=logits.device)
    kl = zero
    if teacher is not None:
        with torch.no_grad():
            t_logits = teacher(**b.inputs()).logits.float()[keep]
        kl = kl_sum(logits, t_logits, temperature)
    return Losses(ce, kl, zero, zero, int(keep.sum()))


def batch_losses(model: Any, batch: torch.Tensor | Seq2SeqBatch, teacher: Any | None, cfg: UptrainConfig) -> Losses:
    """The loss terms of one micro-batch: packed token blocks of a decoder, or an encoder-decoder's batch."""
    te = cfg.teacher
    if isinstance(batch, Seq2SeqBatch):
        return seq2seq_losses(model, batch, teacher, te.temperature)
    return token_losses(model, batch, teacher, te.temperature, hidden=te.hidden_weight > 0, layer=te.layer_weight > 0)


def predicted_tokens(batch: torch.Tensor | Seq2SeqBatch) -> int:
    """How many tokens of a micro-batch have a loss."""
    return batch.predicted() if isinstance(batch, Seq2SeqBatch) else batch[:, 1:].numel()


@torch.no_grad()
def evaluate(accelerator: Any, model: Any, data: Any, micro: int) -> float:
    """Held-out loss per predicted token, split across processes: over packed blocks (a
    decoder's next tokens) or encoder-decoder examples (the target tokens)."""
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    # Every process runs the same number of forwards (FSDP needs it); padding rows weigh 0.
    per_rank = math.ceil(len(data) / world)
    mine = list(range(rank * per_rank, min(len(data), (rank + 1) * per_rank)))
    mine_padded = mine + [0] * (per_rank - len(mine))
    nll = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for i in range(0, per_rank, micro):
        idx = mine_padded[i:i + micro]
        real = sum(1 for j in range(i, i + len(idx)) if j < len(mine))
        if isinstance(data, torch.Tensor):
            x = data[idx].to(accelerator.device)
            logits = model(input_ids=x).logits[:, :-1].float()
            per_tok = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
            nll[0] += per_tok[:real].sum().double()
            nll[1] += per_tok[:real].numel()
            continue
        b = data.batch(idx, idx).to(accelerator.device)
        logits = model(**b.inputs()).logits.float()
        per_tok = F.cross_entropy(logits.transpose(1, 2), b.labels, reduction="none", ignore_index=IGNORE)
        nll[0] += per_tok[:real].sum().double()
        nll[1] += (b.labels[:real] != IGNORE).sum()
    nll = accelerator.reduce(nll, "sum")
    model.train()
    return float(nll[0] / nll[1])
