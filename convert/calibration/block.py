"""One decoder block during calibration, and what a fit sees of it.

`Block` is block L of the skeleton: loaded on the device or freed, its attention weights
swappable between the original and a converted set, run on a span of a stream. A fit
receives a `BlockContext` (the block, the streams and the rows to use, the geometry and
the target head count) and returns a `Fitted`; `Fit` is the protocol a calibrated method
implements (`refit.AlignRefit` is the one there is), and the stage drives it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from gqakit.convert.align import expand_kv
from gqakit.convert.calibration import attention as causal
from gqakit.convert.calibration.memory import empty_cache
from gqakit.convert.calibration.skeleton import BlockCall, Skeleton, Stop, call_block
from gqakit.convert.calibration.streams import Streams
from gqakit.convert.layout import AttnHeads, layer_names, write_heads
from gqakit.core import arch as archmod


class Block:
    """Decoder block L of `skeleton`, loaded on creation."""

    def __init__(self, skeleton: Skeleton, spec: archmod.ArchSpec, L: int, *, kv_heads: int, dtype: torch.dtype,
                 device: str, streams: Streams, calls: dict[int, list[BlockCall]], autocast: bool = False):
        """`autocast`: the passes (`run`) compute in bfloat16 over the block's `dtype` weights."""
        self.skeleton, self.spec, self.L, self.kv_heads = skeleton, spec, L, kv_heads
        self.dtype, self.device, self.streams, self.calls = dtype, device, streams, calls
        self.autocast = autocast
        a = spec.attention
        self.prefix = skeleton.block_names[L] + "."
        attn = a.prefix.format(layer=L)
        self.q_name = (attn + (a.q or a.qkv))[len(self.prefix):]
        self.o_name = (attn + a.o)[len(self.prefix):]
        self.names = layer_names(spec, L)
        on_meta = dict(skeleton.blocks[L].named_parameters())
        self.attn_rel = {n: n[len(self.prefix):] for n in self.names.values() if n[len(self.prefix):] in on_meta}
        self.original: dict[str, Tensor] | None = None
        self.head_bound = spec.position_bias_on(skeleton.opened.config)  # a bias follows each head's index
        # the config the block's attention reads its implementation from (`attention.installed`)
        self.attn_config = next((m.config for m in skeleton.blocks[L].modules() if hasattr(m, "config")), None)
        self.load()

    def load(self) -> None:
        self.block = self.skeleton.load_block(self.L)
        params = dict(self.block.named_parameters())
        self.original = {n: params[r].data for n, r in self.attn_rel.items()}

    def free(self) -> None:
        self.original = None
        self.skeleton.free_block(self.L)
        empty_cache(self.device)

    def source_attention(self) -> dict[str, Tensor]:
        """The block's attention tensors as stored in the source model's files, by source name."""
        return {n: self.skeleton.source.get(self.skeleton.src(n)) for n in self.attn_rel}

    def rest_names(self) -> list[str]:
        """The block's parameters outside its attention projections (MLP, norms), block-relative."""
        attn = set(self.attn_rel.values())
        return [r for r, _ in self.block.named_parameters() if r not in attn]

    def trained_rest(self) -> dict[str, Tensor]:
        """`rest_names`' current values by source tensor name, on the CPU."""
        sk = self.skeleton
        return {sk.src(self.prefix + r): self.block.get_parameter(r).detach().cpu() for r in self.rest_names()}

    @property
    def q_in(self) -> Any:
        return self.block.get_submodule(self.q_name)

    @property
    def o_mod(self) -> Any:
        return self.block.get_submodule(self.o_name)

    def o_bias(self) -> Tensor | None:
        rel = (self.names["o.weight"][: -len("weight")] + "bias")[len(self.prefix):]
        params = dict(self.block.named_parameters())
        return params[rel].data.to(torch.float64) if rel in params else None

    def attention_tensors(self, heads: AttnHeads, dtype: torch.dtype | None = None, *,
                          expand: bool = True) -> dict[str, Tensor]:
        """`heads` as this block's attention tensors (K/V repeated back to the block's head count,
        unless `expand` is false: then with the K/V heads of `heads`; for a position scheme bound
        to the head index, every head back at its source index), in `dtype` (default: the block's)."""
        if expand:
            heads = expand_kv(heads, self.kv_heads)
        elif self.head_bound:
            raise ValueError("a position scheme bound to the head index takes the K/V heads expanded")
        back = self._source_order(heads)
        if back is not None:
            q_back, kv_back = back
            pick = lambda t, p: None if t is None else t[p]  # noqa: E731
            heads = AttnHeads(q=heads.q[q_back], k=heads.k[kv_back], v=heads.v[kv_back], o=heads.o[:, q_back],
                              q_bias=pick(heads.q_bias, q_back), k_bias=pick(heads.k_bias, kv_back),
                              v_bias=pick(heads.v_bias, kv_back))
        return write_heads(self.spec, heads, self.L, {n: dtype or self.dtype for n in self.attn_rel})

    def _source_order(self, heads: AttnHeads) -> tuple[Tensor, Tensor] | None:
        """The permutations (query heads, KV heads) that put `heads` (with KV heads expanded to the
        block's count) back in source order, where the block's position scheme follows the head
        index (`ArchSpec.position_bias_on`) and a grouping moved them; None otherwise."""
        order = heads.q_order
        if not self.head_bound or order is None or order == list(range(len(order))):
            return None
        r = len(order) // self.kv_heads
        kv_order = [order[j * r] // r for j in range(self.kv_heads)]
        return torch.tensor(order).argsort(), torch.tensor(kv_order).argsort()

    def in_head_order(self, rows: Tensor, heads: AttnHeads) -> Tensor:
        """Rows of o_proj's input as the block computed them with `attention_tensors(heads)`, with
        their columns in the order of `heads`' query heads."""
        if self._source_order(heads) is None:
            return rows
        order = torch.tensor(heads.q_order, device=rows.device)
        return rows.reshape(rows.shape[0], len(heads.q_order), -1)[:, order].reshape(rows.shape[0], -1)

    def weights(self, heads: AttnHeads) -> dict[str, Tensor]:
        """`attention_tensors` on the device."""
        return {n: t.to(self.device) for n, t in self.attention_tensors(heads).items()}

    def use(self, weights: dict[str, Tensor]) -> None:
        cur = dict(self.block.named_parameters())
        for n, r in self.attn_rel.items():
            cur[r].data = weights[n]

    def call(self, batch: int) -> BlockCall:
        """This block's recorded extra inputs for a span of `batch` sequences."""
        return self.calls[batch][self.L]

    def run(self, sl: slice, x: Tensor | str) -> Tensor | None:
        """The block on span `sl` of a stream (by name) or on `x`; None when a hook stopped it."""
        if isinstance(x, str):
            x = self.streams.get(x, sl, self.dtype)
        try:
            # the blocked attention where it is the faster forward: under bfloat16 autocast
            with (causal.installed(self.attn_config) if self.autocast else nullcontext(),
                  torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16, enabled=self.autocast)):
                out = call_block(self.block, x, self.call(sl.stop - sl.start))
        except Stop:
            return None
        return out.to(self.dtype)


class Grab:
    """Forward pre-hook (or hook) on a submodule that keeps its input (output) rows."""

    def __init__(self, module: Any, output: bool = False, stop: bool = False):
        self.rows: Tensor | None = None
        self.stop = stop
        self.handle = (module.register_forward_hook(self._out) if output
                       else module.register_forward_pre_hook(self._in))

    def _in(self, mod: Any, args: tuple) -> None:
        self.rows = args[0].reshape(-1, args[0].shape[-1])
        if self.stop:
            raise Stop

    def _out(self, mod: Any, args: tuple, out: Tensor) -> None:
        self.rows = out.reshape(-1, out.shape[-1])
        if self.stop:
            raise Stop

    def remove(self) -> None:
        self.handle.remove()


@dataclass
class BlockContext:
    """What a fit sees of block L: the loaded block, both streams and the rows to use."""

    block: Block
    streams: Streams
    spans: list[slice]                                    # the calibration sequences, a batch at a time
    masks: Callable[[slice], tuple[Tensor, Tensor, Tensor]]  # rows of a span: fitted, measured, first positions
    spec: archmod.ArchSpec
    shape: archmod.Shape                                  # the source geometry
    num_kv_heads: int                                     # G, the target
    hidden: int
    tick: Callable[[int], None]                           # progress: units done
    note: Callable[[str], None]                           # progress: a status text
    advanced: set[int] = field(default_factory=set)       # spans of the original stream already advanced
    passes: list[slice] = field(default_factory=list)     # consecutive spans a pass runs at once (`pass_groups`)

    def __post_init__(self) -> None:
        self.passes = self.passes or list(self.spans)

    @property
    def layer(self) -> int:
        return self.block.L

    def spans_in(self, sl: slice) -> list[slice]:
        """The spans that make up `sl` (a span or one of `passes`)."""
        return [s for s in self.spans if sl.start <= s.start < sl.stop]

    def done(self, sl: slice) -> None:
        """Progress: a unit for each span in `sl`."""
        for _ in self.spans_in(sl):
            self.tick(1)

    def advance_original(self, sl: slice, value: Tensor) -> None:
        """Store the original block's output on `sl` (a span or a pass's spans; a fit that runs
        the original block anyway saves the stage that pass; the stage advances the spans left)."""
        self.streams.put("orig", sl, value)
        self.advanced.update(s.start for s in self.spans_in(sl))


@dataclass
class Fitted:
    """A fit's answer for one block."""

    heads: AttnHeads                    # the converted attention, G K/V heads
    weights: dict[str, Tensor]          # the same as this block's tensors on the device (K/V repeated)
    rest: dict[str, Tensor] = field(default_factory=dict)  # other trained tensors of the block, by source name


class Fit(Protocol):
    """A calibrated method, fitted one block at a time by the stage (`stage.CalibrationStage`)."""

    def units(self, n_spans: int, layer: int) -> int:
        """Progress units block `layer` takes (the stage adds its own pass over the spans)."""

    def steps(self, layer: int) -> int:
        """Of those, the optimisation steps (0: passes over the spans only)."""

    def fit(self, ctx: BlockContext) -> Fitted:
        """Fit block `ctx.layer`. On return the block is loaded, with either weights set."""

    def record(self) -> dict[str, Any]:
        """Keys added to the calibration record once every block is done."""

    def describe(self, calibration: dict[str, Any]) -> str:
        """What the method did, in one line for the model card, from the calibration record."""
