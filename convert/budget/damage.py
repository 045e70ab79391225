"""The damage of converting one layer alone: the loss increase on calibration text.

A grouped layer with G KV heads computes exactly what a multi-head layer computes whose
K/V heads are the G pooled heads repeated back to the source's count (`repeated`: query
head j reads KV head j // (H / G) either way). So each candidate is measured on the loaded
source model itself: write the layer's converted heads, repeated, into its weights, run the
calibration batches, put the source weights back. No model class changes, and the loss is
the converted model's loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from gqakit.convert.budget.stream import SourceStream
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.layout import AttnHeads, layer_names, read_heads, write_heads
from gqakit.convert.methods import method_function
from gqakit.convert.pooling import PoolContext
from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError


def candidate_heads(num_heads: int, num_kv_heads: int) -> list[int]:
    """The G a layer may take, largest first: the divisors of its query heads that are at
    most its KV heads and divide them (contiguous pooling needs groups of equal size)."""
    return [g for g in range(num_kv_heads, 0, -1) if num_heads % g == 0 and num_kv_heads % g == 0]


def repeated(h: AttnHeads, times: int) -> AttnHeads:
    """The pooled K/V heads (weights, biases, per-head k norms) repeated `times` each, in place."""
    rep = lambda t: None if t is None else t.repeat_interleave(times, dim=0)  # noqa: E731
    return h.replace(k=rep(h.k), v=rep(h.v), k_bias=rep(h.k_bias), v_bias=rep(h.v_bias), k_norm=rep(h.k_norm))


@dataclass(frozen=True)
class Damage:
    base_loss: float                     # mean loss per token of the source on the calibration text
    per_layer: list[dict[int, float]]    # layer -> {G: loss increase when only that layer has G heads}
    tokens: int                          # predicted tokens per measurement


def default_batch(seqs: Tensor, vocab: int) -> int:
    """Sequences per forward: the logits of a batch stay near 128 MiB in float32."""
    return max(1, min(seqs.shape[0], (1 << 25) // max(1, seqs.shape[1] * vocab)))


def measure_damage(model: torch.nn.Module, spec: archmod.ArchSpec, shape: archmod.Shape, seqs: Tensor, *,
                   method: str, candidates: Sequence[int], device: torch.device | str = "cpu", seed: int = 0,
                   batch: int | None = None, progress: bool = True) -> Damage:
    """For each decoder layer and each G in `candidates` below the source's KV heads, the loss
    increase on `seqs` when only that layer is converted to G by `method` (a method that needs
    no data), contiguous groups. The model's weights are restored after each measurement."""
    device = torch.device(device)
    KV = shape.num_kv_heads
    todo = [g for g in candidates if g != KV]
    params = dict(model.named_parameters())
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if batch is None:
        batch = default_batch(seqs, vocab)
    fn = method_function(method)
    gen = torch.Generator().manual_seed(seed)
    bar = tqdm(total=1 + shape.num_layers * len(todo), desc="measuring each layer's damage", unit="pass",
               disable=not progress)
    stream = SourceStream(model, spec, shape.num_layers, seqs, batch, device)  # the loss passes start at the layer
    base = stream.base_loss
    bar.update(1)
    per_layer: list[dict[int, float]] = []
    for layer in range(shape.num_layers):
        if layer:
            stream.advance()  # the source's weights are in the model
        saved, heads = layer_heads(model, spec, shape, layer, params)
        damage = {KV: 0.0}
        for g in todo:
            try:
                _write(params, spec, shape, layer, heads, g, fn, gen, saved)
                loss = stream.loss()
            finally:
                with torch.no_grad():
                    for n, t in saved.items():
                        params[n].copy_(t)
            if not math.isfinite(loss):
                raise GqakitError(f"the calibration loss is not finite with layer {layer} at G={g}")
            damage[g] = loss - base
            bar.update(1)
        per_layer.append(damage)
    bar.close()
    return Damage(base, per_layer, int(seqs[:, 1:].numel()))


def layer_heads(model: torch.nn.Module, spec: archmod.ArchSpec, shape: archmod.Shape, layer: int,
           params: dict[str, torch.nn.Parameter]) -> tuple[dict[str, Tensor], AttnHeads]:
    """A copy of the layer's attention tensors, and its heads (float64)."""
    missing = [n for role, n in layer_names(spec, layer).items() if role.endswith("weight") and n not in params]
    if missing:
        raise GqakitError(f"cannot measure the KV damage: the loaded model has no tensor {missing[0]}")
    saved = {n: params[n].detach().clone() for n in layer_names(spec, layer).values() if n in params}
    heads = read_heads(spec, shape, {n: t.to("cpu") for n, t in saved.items()}, layer, dtype=torch.float64)
    return saved, heads


def _write(params: dict[str, torch.nn.Parameter], spec: archmod.ArchSpec, shape: archmod.Shape, layer: int,
           heads: AttnHeads, g: int, fn: Any, gen: torch.Generator, saved: dict[str, Tensor]) -> None:
    """The layer converted to G=`g` by `fn`, its K/V heads repeated back, into the model's weights."""
    groups = GROUPINGS["contiguous"](heads, g, rotary_style=spec.rotary.style, rotary_dim=shape.rotary_dim)
    new = fn(heads, PoolContext(g, groups, spec.rotary.style, shape.rotary_dim, layer, gen))
    tensors = write_heads(spec, repeated(new, shape.num_kv_heads // g), layer, {n: t.dtype for n, t in saved.items()})
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t.to(params[n].device))


def apply_plan(model: torch.nn.Module, spec: archmod.ArchSpec, shape: archmod.Shape, kv_heads: Sequence[int], *,
               method: str, seed: int = 0) -> None:
    """Convert the loaded source model in place to the per-layer plan `kv_heads` (by `method`,
    contiguous groups), each layer's K/V heads repeated back: the same function as the converted
    model, in the source's shapes (what a plan's quality is measured with before it is written)."""
    if len(kv_heads) != shape.num_layers:
        raise GqakitError(f"a plan of {len(kv_heads)} layers for a model of {shape.num_layers}")
    params = dict(model.named_parameters())
    fn, gen = method_function(method), torch.Generator().manual_seed(seed)
    for layer, g in enumerate(kv_heads):
        if g not in candidate_heads(shape.num_heads, shape.num_kv_heads):
            raise GqakitError(f"G={g} in layer {layer}: choose from {candidate_heads(shape.num_heads, shape.num_kv_heads)}")
        if g != shape.num_kv_heads:
            saved, heads = layer_heads(model, spec, shape, layer, params)
            _write(params, spec, shape, layer, heads, g, fn, gen, saved)
