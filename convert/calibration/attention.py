"""A faster causal attention for align-refit's block passes and reconstruction steps on the CPU.

A reconstruction step runs the block's attention forward and backward on a few 512-token
sequences, and PyTorch's CPU `scaled_dot_product_attention` kernels take most of it: they
neither skip the masked half of the causal scores in the backward nor use the fact that the
query heads of a group share one key and value head. `causal_attention` computes the same
softmax attention in blocks of `QUERY_BLOCK` query positions (fewer for narrow heads), each
against the keys up to its last position only, with the query heads of a KV group stacked into
one matrix product; autograd differentiates it. The calibration's blocks use it while
`installed` (where they ask for transformers' "sdpa" implementation): in the steps, and in the
bfloat16 passes (in float32 and float64, PyTorch's forward-only kernel is the faster); every
call it does not cover (a mask, a position bias, a softcap, a sliding window, dropout, a cache)
goes to that implementation unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

NAME = "gqakit_causal"
# query positions per block, on 512-token sequences: 128 for heads of 32 dimensions or more (the
# fastest of 64-512 at 64), 64 for narrower ones (at 8: a fifth faster than 128, the scores'
# memory traffic dominates and a smaller block wastes less of its masked half)
QUERY_BLOCK, NARROW_QUERY_BLOCK, NARROW_HEAD = 128, 64, 32
_UNSUPPORTED = ("softcap", "sliding_window", "position_bias", "s_aux", "sinks")


def causal_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                     **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function interface: query [B, H, T, d], key and value [B, KV, S, d]
    (H a multiple of KV); returns the output [B, T, H, d] and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    B, H, T, d = query.shape
    KV, S = key.shape[1], key.shape[2]
    if (attention_mask is not None or not causal or dropout or T < 2 or S != T or H % KV
            or any(kwargs.get(k) is not None for k in _UNSUPPORTED)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    r = H // KV
    q = query.reshape(B, KV, r, T, d) * (d ** -0.5 if scaling is None else scaling)
    cast = not torch.is_autocast_enabled(query.device.type)  # under autocast the products pick their dtype
    outs = []
    qb = QUERY_BLOCK if d >= NARROW_HEAD else NARROW_QUERY_BLOCK
    for lo in range(0, T, qb):
        hi = min(lo + qb, T)
        s = torch.matmul(q[:, :, :, lo:hi].reshape(B, KV, r * (hi - lo), d), key[:, :, :hi].transpose(-1, -2))
        s[..., lo:hi].masked_fill_(_future(hi - lo, r, query.device), float("-inf"))  # the block's own keys
        p = s.softmax(-1)
        p = p.to(value.dtype) if cast else p
        outs.append(torch.matmul(p, value[:, :, :hi]).reshape(B, KV, r, hi - lo, d))
    out = torch.cat(outs, dim=3).reshape(B, H, T, d)
    return out.transpose(1, 2).contiguous(), None


@lru_cache(maxsize=64)
def _future(n: int, r: int, device: torch.device) -> Tensor:
    """The scores to mask in a block of `n` queries against its own `n` keys (the keys before the
    block are all visible), for `r` query heads stacked: each query's later keys. Made outside
    inference mode: the steps' backward keeps it."""
    with torch.inference_mode(False):
        return ~torch.ones(n, n, dtype=torch.bool, device=device).tril().repeat(r, 1)


@lru_cache(maxsize=1)
def _register() -> None:
    """`causal_attention` in transformers' attention registry, under `NAME` (once per process)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, causal_attention)


@contextmanager
def installed(config: Any) -> Iterator[bool]:
    """`causal_attention` in place of "sdpa" for the blocks built from `config` while inside;
    yields whether it was installed (not for another implementation). The config's own back on exit."""
    before = getattr(config, "_attn_implementation", None)
    if before != "sdpa":
        yield False
        return
    _register()
    config._attn_implementation = NAME
    try:
        yield True
    finally:
        config._attn_implementation = before
