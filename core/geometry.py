"""Attention geometry: the numbers the table reads off a model's config (`core.arch.shape_of`),
which every stage prices and shapes tensors by: layers, query and KV heads (per layer when
they differ), head and hidden sizes, the rotated dims, the context length and the layers that
attend over a sliding window; and an encoder-decoder's pair of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = ["SITE_NAMES", "Seq2SeqShape", "Shape"]


@dataclass(frozen=True)
class Shape:
    """The attention geometry of one model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rotary_dim: int  # dims of each head that are rotated (0: no rotary)
    max_positions: int | None = None  # the context length, when the config states one
    # each layer's KV heads when they differ between layers (`num_kv_heads` is then their
    # largest); None: every layer has `num_kv_heads`
    kv_heads_per_layer: tuple[int, ...] | None = None
    # each layer's sliding window (the last positions its attention sees, and all its cache
    # needs to hold) where some layers slide, None in a full-attention layer; None: no layer slides
    layer_windows: tuple[int | None, ...] | None = None

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_heads_of(self, layer: int) -> int:
        """The KV heads of decoder layer `layer` (0-based)."""
        return self.num_kv_heads if self.kv_heads_per_layer is None else self.kv_heads_per_layer[layer]

    def at(self, layer: int) -> Shape:
        """This geometry with layer `layer`'s KV heads in every layer (the head math of one layer)."""
        if self.kv_heads_per_layer is None:
            return self
        return replace(self, num_kv_heads=self.kv_heads_per_layer[layer], kv_heads_per_layer=None)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer` (0-based); None: it attends to every position."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    def layer_heads(self, kv_heads: int | Sequence[int] | None = None) -> list[int]:
        """Each layer's KV heads: this shape's own, or `kv_heads` (one count for every layer, or one per layer)."""
        if kv_heads is None:
            kv_heads = self.kv_heads_per_layer or self.num_kv_heads
        return [kv_heads] * self.num_layers if isinstance(kv_heads, int) else list(kv_heads)

    def kv_bytes_per_token(self, bytes_per_elem: int, kv_heads: int | Sequence[int] | None = None) -> int:
        """KV-cache bytes one token costs: K and V, every layer, every KV head, summed over the
        layers (`kv_heads` instead of this shape's own, to price a conversion target: one count
        for every layer, or one per layer). Sliding layers included: a token within their window
        costs them as much (`kv_cache_bytes` counts what a cache of some length holds)."""
        return 2 * sum(self.layer_heads(kv_heads)) * self.head_dim * bytes_per_elem

    def kv_cache_bytes(self, bytes_per_elem: int, positions: int,
                       kv_heads: int | Sequence[int] | None = None) -> int:
        """KV-cache bytes of one sequence at `positions` positions: a full-attention layer holds
        all of them, a sliding layer min(window, positions) (as transformers' static cache sizes
        it; also what a decode step at that depth reads). Without sliding layers, exactly
        `positions` x `kv_bytes_per_token`."""
        heads = self.layer_heads(kv_heads)
        windows = self.layer_windows or (None,) * len(heads)
        held = sum(h * (positions if w is None else min(w, positions)) for h, w in zip(heads, windows))
        return 2 * held * self.head_dim * bytes_per_elem

    def window_shares(self, kv_heads: int | Sequence[int] | None = None) -> dict[int, float]:
        """Each sliding window's share of a token's KV bytes (the layers with that window over
        all layers, weighted by their KV heads); empty without sliding layers."""
        heads = self.layer_heads(kv_heads)
        out: dict[int, float] = {}
        for h, w in zip(heads, self.layer_windows or ()):
            if w is not None:
                out[w] = out.get(w, 0.0) + h / sum(heads)
        return out


# How the model card and gqakit_convert.json name each site an encoder-decoder's conversion grouped.
SITE_NAMES = {"self": "decoder.self_attention", "cross": "decoder.cross_attention",
              "encoder": "encoder.self_attention"}


@dataclass(frozen=True)
class Seq2SeqShape:
    """The attention geometry of an encoder-decoder: the encoder's self-attention, and the
    decoder's (its cross-attention has the decoder's query and KV heads)."""

    encoder: Shape
    decoder: Shape

    def cache_bytes(self, bytes_per_elem: int, *, input_tokens: int, output_tokens: int,
                    kv_heads: int | None = None) -> tuple[int, int]:
        """(self-attention, cross-attention) cache bytes of one sequence: K and V of every
        decoder layer, per output token and per input token (`kv_heads`: a conversion target)."""
        per_token = self.decoder.kv_bytes_per_token(bytes_per_elem, kv_heads)
        return per_token * output_tokens, per_token * input_tokens


