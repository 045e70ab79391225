"""The source model's residual stream at one decoder layer, kept batch by batch, so that the
damage passes of a layer start at that layer instead of at the embedding.

A layer's damage is measured with only that layer changed, so the hidden state entering it is
the source's own: it is computed once, kept for every calibration batch, and moved on by one
block per layer (`advance`). Within `at(i)`, a forward of the loaded model on batch i runs the
model's own code (embedding, masks, rotary tables, the final norm, the head and its logit
transforms), but every block before the current layer returns its input unchanged, in the
structure the block returns, and the current layer reads the kept hidden state in place of the
one it is given. So the blocks before the layer are not recomputed, and what the layer and those
after it compute is what a full forward computes: the same inputs through the same operations.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError


def token_loss(model: torch.nn.Module, ids: Tensor) -> tuple[float, int]:
    """The summed next-token loss (float32 logits) of one batch of sequences, and its count."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    total = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                    reduction="sum"))
    return total, ids[:, 1:].numel()


def _hidden_of(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


class SourceStream:
    """The source's hidden state entering decoder layer `layer` (0 on creation), per batch of
    `batch` sequences of `seqs`; `base_loss` is the source's mean next-token loss on `seqs`,
    from the full forward that starts the stream."""

    def __init__(self, model: torch.nn.Module, spec: archmod.ArchSpec, num_layers: int, seqs: Tensor, batch: int,
                 device: torch.device | str = "cpu"):
        self.model, self.seqs, self.device = model, seqs, torch.device(device)
        self.blocks = [model.get_submodule(spec.block_name(L)) for L in range(num_layers)]
        self.spans = [slice(i, min(i + batch, seqs.shape[0])) for i in range(0, seqs.shape[0], batch)]
        self.layer = 0
        self.hidden: list[Tensor] = []
        self._tails: list[tuple | None] = [None] * num_layers  # each block's output after its hidden state
        first: list[Tensor] = []
        seen: list[int] = []

        def out_hook(L: int, out: Any) -> None:
            if L not in seen:
                seen.append(L)
                self._tails[L] = tuple(out[1:]) if isinstance(out, tuple) else None

        hooks = [self.blocks[0].register_forward_pre_hook(lambda m, a, k: first.append(_hidden_of(a, k)),
                                                          with_kwargs=True)]
        hooks += [b.register_forward_hook(lambda m, a, out, L=L: out_hook(L, out)) for L, b in enumerate(self.blocks)]
        total, n = 0.0, 0
        try:
            with torch.inference_mode():
                for sl in self.spans:
                    t, c = token_loss(model, self.ids(sl))
                    total, n = total + t, n + c
        finally:
            for h in hooks:
                h.remove()
        if len(first) != len(self.spans):
            raise GqakitError("cannot measure the KV damage: the forward never reached the first decoder block")
        self.hidden = first
        self.base_loss = total / n

    def ids(self, sl: slice) -> Tensor:
        return self.seqs[sl].to(self.device)

    def batches(self) -> Iterator[tuple[int, slice]]:
        return iter(enumerate(self.spans))

    @contextmanager
    def at(self, i: int) -> Iterator[None]:
        """Forwards on batch i start at the current layer, with its kept input (module docstring)."""
        skipped = self.blocks[:self.layer]
        saved = [b.__dict__.get("forward") for b in skipped]
        for b, tail in zip(skipped, self._tails):
            b.forward = (lambda *a, **k: _hidden_of(a, k)) if tail is None else \
                (lambda *a, _t=tail, **k: (_hidden_of(a, k), *_t))
        kept = self.hidden[i]

        def swap(m: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (kept, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": kept}

        hook = self.blocks[self.layer].register_forward_pre_hook(swap, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()
            for b, fwd in zip(skipped, saved):
                if fwd is None:
                    del b.forward
                else:
                    b.forward = fwd

    def loss(self) -> float:
        """The mean next-token loss with the model's current weights, computed from the current layer on."""
        total, n = 0.0, 0
        with torch.inference_mode():
            for i, sl in self.batches():
                with self.at(i):
                    t, c = token_loss(self.model, self.ids(sl))
                total, n = total + t, n + c
        return total / n

    def advance(self) -> None:
        """The kept inputs moved on through the current layer, with the model's current weights."""
        outs: list[Tensor] = []

        class Done(Exception):
            pass

        def grab(m: Any, a: tuple, out: Any) -> None:
            outs.append(out[0] if isinstance(out, tuple) else out)
            raise Done

        hook = self.blocks[self.layer].register_forward_hook(grab)
        try:
            with torch.inference_mode():
                for i, sl in self.batches():
                    with self.at(i):
                        try:
                            self.model(input_ids=self.ids(sl))
                        except Done:
                            pass
        finally:
            hook.remove()
        self.hidden, self.layer = outs, self.layer + 1

    def advanced_to(self, layer: int) -> SourceStream:
        while self.layer < layer:
            self.advance()
        return self
