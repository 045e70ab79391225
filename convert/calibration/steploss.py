"""The loss of align-refit's reconstruction steps on one span (`SpanLoss`): the relative squared
error between the converted block's output on the converted stream and the original block's
output on the original stream, on the span's fitted (or measured) rows; with `loss=attention`,
the o_proj refit's weighted error of the residual stream after attention instead (the block is
stopped after o_proj, so a step never runs its MLP).

A layer takes thousands of steps, and on a small model a step is a few milliseconds, so what is
the same at every step is prepared once per layer:

  - the trained and frozen tensors are put into the block's modules directly (and the block's
    own put back afterwards), not through `torch.func.functional_call` on a dict rebuilt at
    every step;
  - the attention tensors are written in the step dtype when the block's dtype is at least as
    wide (the round trip through the wider dtype is exact both ways, gradients included);
  - each span's rows (`ctx.masks`) are taken once, and no row selection is made where a span
    keeps every row;
  - where they are small (`CACHE_BYTES`), each span's converted-stream input and original-stream
    target rows (with the loss's denominators) are kept in the step dtype for the layer; larger
    streams are converted span by span, at every step, as they are read.

Each of these computes the same numbers in the same order as the plain per-step path, so the
steps' results are the same bit for bit. One more saving changes only the order of some sums: where
the block's attention takes them (`SpanLoss._compact_ok`, checked on each layer's first span), the
pooled K/V heads are put into the block as they are, G of them, rather than repeated to the block's
KV head count, so a step's K/V projections and their gradients cost G/KV of the repeated ones'.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor

from gqakit.convert.calibration import attention as causal
from gqakit.convert.calibration.block import BlockContext, Grab
from gqakit.convert.calibration.skeleton import Stop
from gqakit.convert.layout import AttnHeads

# A layer's float32 copies of both streams' spans are kept while they take at most this much
# memory (stories260K at 65,536 tokens: 32 MiB); beyond it they are converted at every step,
# where the conversion is a small part of a step on a model that wide.
CACHE_BYTES = 64 * 2**20


def _clone_tree(x: Any, dtype: torch.dtype) -> Any:
    """Tensors in nested tuples / lists / dicts cloned (inference-mode tensors made usable by
    autograd), the floating ones in `dtype`."""
    if isinstance(x, Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone_tree(i, dtype) for i in x)
    if isinstance(x, dict):
        return {k: _clone_tree(v, dtype) for k, v in x.items()}
    return x


class SpanLoss:
    """The reconstruction loss of block `ctx.layer` on a span, as a function of the trained tensors
    (`parts` of the pooled heads by name, `rest` of the block by block-relative name). Use it
    inside `installed()`, which holds the frozen tensors in the block for the layer's steps."""

    def __init__(self, ctx: BlockContext, pooled: AttnHeads, parts: list[str], rest: list[str], *,
                 sd: torch.dtype, autocast: bool, device: str,
                 targets: dict[int, tuple[Tensor, Tensor]] | None = None):
        """`targets`: each span's attention-output targets and row weights, by its first sequence
        (the attention loss; None: the block loss)."""
        blk = ctx.block
        self.targets = targets
        self.grab: Grab | None = None
        self.ctx, self.blk, self.pooled, self.parts, self.rest = ctx, blk, pooled, parts, rest
        self.sd, self.autocast, self.device, self.D = sd, autocast, device, ctx.hidden
        # written in the step dtype where the block's dtype would round nothing away on the way
        wide = torch.finfo(blk.dtype).bits >= torch.finfo(sd).bits
        self.write_dtype = sd if wide else blk.dtype
        # the frozen tensors in the step dtype (the block's own when they are in it already)
        attn = set(blk.attn_rel.values())
        self.frozen = {r: t.detach().to(sd) for r, t in blk.block.named_parameters()
                       if r not in rest and r not in attn and t.dtype != sd}
        self.slots = {r: self._slot(r) for r in [*attn, *rest, *self.frozen]}
        self.calls: dict[int, tuple] = {}
        self.masks: dict[tuple[int, int, int], Tensor | None] = {}
        self.inputs: dict[tuple[int, int, int], tuple[Tensor, Tensor, Tensor]] = {}
        n_tok = ctx.streams.orig.shape[0] * ctx.streams.orig.shape[1]
        self.cache = 2 * n_tok * self.D * torch.finfo(sd).bits // 8 <= CACHE_BYTES
        # the pooled K/V heads computed once each rather than repeated to the block's count, where the
        # block's attention takes them so (`_compact_ok`, decided on the first span); None: not decided yet
        self.compact: bool | None = None if pooled.num_kv_heads < blk.kv_heads and not blk.head_bound else False

    def _slot(self, rel: str) -> tuple[torch.nn.Module, str]:
        owner, _, attr = rel.rpartition(".")
        return (self.blk.block.get_submodule(owner) if owner else self.blk.block), attr

    def _put(self, rel: str, t: Tensor) -> None:
        mod, attr = self.slots[rel]
        mod._parameters[attr] = t

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The frozen tensors in the block's modules for the steps, and the steps' causal attention
        (`attention.causal_attention`); the block's own parameters back on exit (also on an error)."""
        stack = ExitStack()
        saved = {r: mod._parameters[attr] for r, (mod, attr) in self.slots.items()}
        try:
            stack.enter_context(causal.installed(self.blk.attn_config))
            for r, t in self.frozen.items():
                self._put(r, t)
            if self.targets is not None:
                self.grab = Grab(self.blk.o_mod, output=True, stop=True)
            yield
        finally:
            if self.grab is not None:
                self.grab.remove()
                self.grab = None
            stack.close()
            for r, p in saved.items():
                self._put(r, p)
            self.inputs.clear()
            self.calls.clear()

    def mask(self, sl: slice, which: int) -> Tensor | None:
        """Span `sl`'s rows (`which`: 0 fitted, 1 measured, as `ctx.masks`); None when it keeps all."""
        key = (sl.start, sl.stop, which)
        if key not in self.masks:
            m = self.ctx.masks(sl)[which]
            self.masks[key] = None if bool(m.all()) else m
        return self.masks[key]

    def targets_of(self, sl: slice) -> tuple[Tensor, Tensor]:
        """The attention loss's targets and row weights on `sl` (a span, or a pass's spans)."""
        assert self.targets is not None
        parts = [self.targets[s.start] for s in self.ctx.spans_in(sl)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def _call(self, B: int) -> tuple:
        # the recorded block inputs were made under inference mode: clone them for autograd
        if B not in self.calls:
            args, kwargs, positional = self.blk.call(B)
            self.calls[B] = (_clone_tree(args, self.sd), _clone_tree(kwargs, self.sd), positional)
        return self.calls[B]

    def _inputs(self, sl: slice, which: int) -> tuple[Tensor, Tensor, Tensor]:
        """The span's converted-stream input, its original-stream target rows and their squared
        norms (the loss's denominators), in the step dtype."""
        key = (sl.start, sl.stop, which)
        got = self.inputs.get(key)
        if got is None:
            streams, mask = self.ctx.streams, self.mask(sl, which)
            x = streams.get("new", sl, self.sd)
            if self.targets is None:
                y = streams.get("orig", sl, self.sd).reshape(-1, self.D)
                y = y if mask is None else y[mask]
                den = y.pow(2).sum(1).clamp_min(1e-30)
            else:
                t, w = (a.to(self.device) for a in self.targets_of(sl))
                y, w = (t, w) if mask is None else (t[mask], w[mask])
                y, den = y.to(self.sd), (self.D / w.pow(2)).to(self.sd)  # |post|^2: relative, as the block loss
            got = (x, y, den)
            if self.cache:
                self.inputs[key] = got
        return got

    def __call__(self, sl: slice, which: int, current: dict[str, Tensor]) -> Tensor:
        if self.compact is None:
            self.compact = self._compact_ok(sl, which, current)
        out, y, den = self._out(sl, which, current, expand=not self.compact, autocast=self.autocast)
        return ((out - y).pow(2).sum(1) / den).mean()

    def _compact_ok(self, sl: slice, which: int, current: dict[str, Tensor]) -> bool:
        """Whether the block computes the same outputs from the pooled K/V heads as they are as from
        them repeated to its own head count: where its attention reshapes K and V by their size and
        groups the query heads by the shapes (`attention.causal_attention`), a step's K/V projections
        and their gradients cost G/KV of the repeated ones'. A block whose code takes the source's KV
        count (a fused projection split by it, a view to it) fails or differs, and keeps the repeated
        heads. Compared once per layer on one span, without autocast: the two differ only in the
        order of the K/V projections' sums (length D) and of the attention's (length T), far within
        16 (D + T) units of rounding of the step dtype, relative to the output's largest value; a
        wrong structure differs by the size of the output."""
        with torch.no_grad():
            ref = self._out(sl, which, current, expand=True, autocast=False)[0]
            try:
                got = self._out(sl, which, current, expand=False, autocast=False)[0]
            except Exception:  # noqa: BLE001  a view, split, norm or assert sized for the source's KV heads
                return False  # the repeated heads, which the block has just run, are the answer
        if got.shape != ref.shape:
            return False
        tol = 16 * (self.D + self.ctx.streams.orig.shape[1]) * torch.finfo(self.sd).eps / 2
        return bool((got - ref).abs().max() <= tol * ref.abs().max().clamp_min(torch.finfo(self.sd).tiny))

    def _out(self, sl: slice, which: int, current: dict[str, Tensor], *, expand: bool,
             autocast: bool) -> tuple[Tensor, Tensor, Tensor]:
        """The block's output rows on span `sl` (the attention's, for the attention loss) with the
        trained tensors `current`, and the span's target rows and denominators (`_inputs`)."""
        heads = self.pooled.replace(**{p: current[p] for p in self.parts})
        w = self.blk.attention_tensors(heads, dtype=self.write_dtype, expand=expand)
        for n, t in w.items():
            self._put(self.blk.attn_rel[n], t.to(self.sd))
        for r in self.rest:
            self._put(r, current[r])
        args, kwargs, positional = self._call(sl.stop - sl.start)
        x, y, den = self._inputs(sl, which)
        with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=autocast):
            try:
                out = self.blk.block(x, *args, **kwargs) if positional else self.blk.block(*args, hidden_states=x,
                                                                                             **kwargs)
            except Stop:  # the attention loss: the attention's output, the rest of the block not run
                assert self.grab is not None and self.grab.rows is not None
                out = self.grab.rows
        out = (out[0] if isinstance(out, tuple) else out).reshape(-1, self.D)
        mask = self.mask(sl, which)
        return (out if mask is None else out[mask]).to(self.sd), y, den
