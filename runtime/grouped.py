"""Grouped decode attention: one query token reads each KV head once for its query group.

`decode_attention` reshapes the H query heads to [B, G, H/G, D] (the H/G heads of a group
become rows) and multiplies them against the group's [B, G, T, D] keys and values: no
`repeat_kv` copy, no per-call conversion of the boolean mask inside SDPA (it is converted
once per step), and the output comes out already in the (B, 1, H, D) layout the output
projection wants.

On the CPU in fp32, `decode_attention(..., fused=True)` runs the compiled kernel of
`cpu_kernels.cpp` instead (`kernels.py`): one pass per group and cache chunk (scores,
softmax and weighted values fused; no score tensor, masked positions never read). Under
`torch.compile` it is called as a custom op (`kernels.ops()`).
"""

from __future__ import annotations

from typing import Any


_MASK: list[Any] = [None, None]  # [the last boolean mask seen, its additive float form]


def _additive(mask: Any, dtype: Any) -> Any:
    """A boolean mask (True = attend) as 0 / -inf, converted once per step, not once per layer.

    transformers builds one mask per forward and hands the same tensor to every layer; the
    last one converted is kept (with its version counter, so an in-place change is seen).
    """
    import torch

    if torch.compiler.is_compiling():  # traced code: no Python-side state; the compiler dedupes
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    try:
        version = mask._version
    except RuntimeError:  # inference tensors have no version counter: identity alone
        version = None
    src, conv = _MASK
    if src is mask and conv is not None and conv[0] == version and conv[1].dtype == dtype:
        return conv[1]
    add = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    _MASK[0], _MASK[1] = mask, (version, add)
    return add


def _fused_mask(query: Any, key: Any, attention_mask: Any) -> Any:
    """The mask as the fused kernel takes it (a contiguous additive [B, T] fp32), or None if it can't."""
    import torch

    b, t = query.shape[0], key.shape[2]
    if attention_mask is None:
        return torch.empty(0)
    m = attention_mask
    if m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != 1 or m.shape[3] != t or m.shape[0] not in (1, b):
        return None
    m = _additive(m, torch.float32) if m.dtype == torch.bool else m
    if m.dtype != torch.float32:
        return None
    return m.reshape(m.shape[0], t).expand(b, t).contiguous()


def _fused_ok(query: Any, key: Any, value: Any) -> bool:
    import torch

    from gqakit.runtime import kernels as cpu_kernels

    return (cpu_kernels.load() is not None
            and all(x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() for x in (query, key, value))
            and query.shape[2] == 1 and query.shape[1] % key.shape[1] == 0)


def fused_applies(query: Any, key: Any, value: Any, attention_mask: Any) -> bool:
    """Whether `decode_attention(..., fused=True)` runs the compiled kernel for these inputs."""
    return _fused_ok(query, key, value) and _fused_mask(query, key, attention_mask) is not None


def decode_attention(query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None,
                     fused: bool = False) -> Any:
    """One query token, grouped: (B, H, 1, D) query, (B, G, T, D) K/V -> (B, 1, H, Dv).

    `attention_mask` is None, a boolean (True = attend) or an additive float mask that
    broadcasts to (B, 1, 1, T). Scores are one `baddbmm` per step and layer (scale and mask
    folded in), then a softmax and one `bmm`; K and V are read once, in place. With
    `fused=True`, the compiled CPU kernel where `fused_applies` (fp32, contiguous, a
    [B, 1, 1, T] mask), else the same matmuls.
    """
    import torch

    mask = _fused_mask(query, key, attention_mask) if fused and _fused_ok(query, key, value) else None
    if mask is not None:
        from gqakit.runtime import kernels as cpu_kernels

        scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
        if torch.compiler.is_compiling():  # an opaque op in the compiled graph
            return cpu_kernels.ops().decode_attention(query, key, value, mask, scale)
        return cpu_kernels.load().decode_attention(query, key, value, mask, scale)

    b, h, _, d = query.shape
    g, t = key.shape[1], key.shape[2]
    r = h // g
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b * g, r, d)
    k = key.reshape(b * g, t, d).transpose(1, 2)  # a view: the cache is not copied
    if attention_mask is None:
        bias = torch.zeros((), dtype=query.dtype, device=query.device).expand(b * g, r, t)
    else:
        m = _additive(attention_mask, query.dtype) if attention_mask.dtype == torch.bool else attention_mask.to(query.dtype)
        bias = m.expand(b, g, r, t) if m.shape[1] == 1 else m.reshape(b, 1, 1, t).expand(b, g, r, t)
        bias = bias.reshape(b * g, r, t)
    scores = torch.baddbmm(bias, q, k, alpha=scale)  # (B*G, H/G, T): each K head read once
    if query.dtype == torch.float32:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.bmm(probs, value.reshape(b * g, t, value.shape[-1]))  # each V head read once
    return out.reshape(b, 1, h, value.shape[-1])
