"""A GQA attention function for decoding that never copies K/V up to all query heads.

transformers' stock SDPA path already avoids the copy in eager decoding (it folds the
query heads of each group, `pack_gqa`), but under `torch.compile`, or on CUDA whenever
a mask is present (always, with a static cache), it falls back to `repeat_kv`, which
materialises H/G copies of the whole cache every step: exactly the memory traffic GQA
exists to save. This module registers `gqakit_sdpa`, which uses the same two tricks
unconditionally:

- decode (one query token): the H/G query heads that share a KV head become H/G query
  *rows* of that one head, so SDPA sees G heads and reads each K/V head once;
- prefill: SDPA's own `enable_gqa=True` on the CPU. On CUDA, a one-off copy of K/V up
  to all heads instead: the static cache hands attention its whole pre-allocated length,
  so prefill is causal over a non-square score matrix (or masked), which flash does not
  take, and whether the memory-efficient kernel takes `enable_gqa` depends on the torch
  release; what is left is the math kernel, whose O(prompt²) score tensor does not fit
  at large batch x prompt. Prefill only: decode steps never copy.

`SdpaSpy` and `describe_path` then check what really reached SDPA in one decode step, so the
results say which path ran instead of assuming it.
"""

from __future__ import annotations

from typing import Any

NAME = "gqakit_sdpa"
# Decode (one query token) kernel: "matmul" (grouped.decode_attention), "cpu" (its fused
# compiled CPU kernel where it applies, else "matmul") or "sdpa" (SDPA with the query heads
# folded per KV head). Each model carries its own choice (`set_decode_kernel`); a module
# without one decodes with "matmul".
DECODE_KERNELS = ("matmul", "cpu", "sdpa")
_ATTR = "gqakit_decode_kernel"


class DecodeKernel:
    """The decode kernel of one model, shared by all its modules (so switching is one assignment)."""

    def __init__(self, name: str = "matmul") -> None:
        self.name = name


def set_decode_kernel(model: Any, name: str) -> str:
    """Choose the decode attention kernel `gqakit_sdpa` runs for `model`; returns the previous one."""
    if name not in DECODE_KERNELS:
        raise ValueError(f"decode kernel must be one of {DECODE_KERNELS}, got {name!r}")
    choice = model.__dict__.get(_ATTR)
    if not isinstance(choice, DecodeKernel):
        choice = DecodeKernel()
        for m in model.modules():  # the attention function is handed its attention module
            object.__setattr__(m, _ATTR, choice)
    prev, choice.name = choice.name, name
    return prev


def decode_kernel_of(module: Any) -> str:
    """The decode kernel chosen for the model `module` belongs to ("matmul" when none was)."""
    choice = getattr(module, _ATTR, None)
    return choice.name if isinstance(choice, DecodeKernel) else "matmul"


def gqa_sdpa_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """Drop-in for transformers' attention functions: (B, H, Q, D) in, (B, Q, H, Dv) out."""
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    b, h, q_len, d = query.shape
    kv_heads = key.shape[1]
    groups = h // kv_heads
    per_head_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] > 1
    kernel = decode_kernel_of(module)
    if q_len == 1 and not per_head_mask and kernel in ("matmul", "cpu"):
        # Two matmuls and a softmax (or the fused CPU kernel), query heads of a group as rows
        # of its K/V head (MHA too, so both sides of a comparison run the same kernel).
        from gqakit.runtime.grouped import decode_attention

        return decode_attention(query, key, value, attention_mask, scaling, fused=kernel == "cpu"), None
    if q_len == 1 and groups > 1 and not per_head_mask:
        # (B, H, 1, D) -> (B, G, H/G, D): rows of one group attend to the same K/V head.
        q = query.reshape(b, kv_heads, groups, d)
        out = sdpa(q, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
        out = out.reshape(b, h, 1, value.shape[-1])
    else:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal and attention_mask is None and q_len > 1)
        kw = {"enable_gqa": True} if groups > 1 else {}
        if groups > 1 and q_len > 1 and query.is_cuda:
            key, value, kw = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), {}
        out = sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                   is_causal=causal, **kw)
    return out.transpose(1, 2).contiguous(), None


FOLDED = "gqakit_sdpa_folded"


def folded_sdpa_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any,
                        **kwargs: Any) -> tuple[Any, None]:
    """transformers' own SDPA attention (T5's position bias included), except that one query
    token without a mask (an encoder-decoder's cross-attention) also has its query heads folded
    per KV head: without a mask transformers hands SDPA `enable_gqa`, which on the CPU reads the
    cache more slowly (at 1 KV head of 12, batch 8 x 4,096 positions: 44 ms against 24 ms per layer)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] == 1 and attention_mask is None and getattr(module, "num_key_value_groups", 1) > 1:
        attention_mask = query.new_zeros(1, 1, 1, key.shape[2])  # "no mask", additive: the folded path
    return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def use_folded_attention(model: Any) -> str:
    """Switch an encoder-decoder to `gqakit_sdpa_folded` where it takes pluggable attention; returns what it runs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FOLDED, folded_sdpa_forward)
    AttentionMaskInterface.register(FOLDED, sdpa_mask)
    try:
        model.set_attn_implementation(FOLDED)
    except (ValueError, AttributeError, NotImplementedError, KeyError):
        pass
    return str(getattr(model.config, "_attn_implementation", None) or "unknown")


def register() -> str:
    """Register `gqakit_sdpa` (attention and mask functions) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_gqa_attention(model: Any, decode_kernel: str = "matmul") -> str:
    """Switch `model` to `gqakit_sdpa` (decoding with `decode_kernel`) when it supports
    pluggable attention; returns what it runs.

    Models that do not (some remote-code folders) keep their own implementation; the
    probe reports what that one does.
    """
    register()
    set_decode_kernel(model, decode_kernel)
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError, NotImplementedError, KeyError):
        pass
    return str(getattr(model.config, "_attn_implementation", None) or "unknown")


class SdpaSpy:
    """Context manager recording the shapes of every SDPA call (for one probe step only)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __enter__(self) -> "SdpaSpy":
        import torch.nn.functional as F

        self._orig = F.scaled_dot_product_attention
        orig = self._orig

        def spy(query, key, value, *args, **kwargs):
            self.calls.append({"q_heads": query.shape[1], "q_rows": query.shape[2], "kv_heads": key.shape[1],
                               "enable_gqa": bool(kwargs.get("enable_gqa", False))})
            return orig(query, key, value, *args, **kwargs)

        from gqakit.runtime import grouped

        self._orig_dec = grouped.decode_attention
        orig_dec = self._orig_dec

        def spy_dec(query, key, value, *args, **kwargs):
            g = key.shape[1]
            fused = kwargs.get("fused") and grouped.fused_applies(query, key, value, args[0] if args else None)
            self.calls.append({"q_heads": g, "q_rows": query.shape[1] // g, "kv_heads": g, "enable_gqa": False,
                               "kernel": "cpu" if fused else "matmul"})
            return orig_dec(query, key, value, *args, **kwargs)

        F.scaled_dot_product_attention = spy
        grouped.decode_attention = spy_dec
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.nn.functional as F

        from gqakit.runtime import grouped

        F.scaled_dot_product_attention = self._orig
        grouped.decode_attention = self._orig_dec


def describe_path(calls: list[dict[str, Any]], heads: int, kv_heads: int) -> dict[str, Any]:
    """Name the path one decode step took, from the SDPA calls it made."""
    if not calls:
        return {"decode_path": "no SDPA call seen (attention computed another way)", "kv_copied": None}
    c = calls[0]
    if c.get("kernel") in ("matmul", "cpu"):
        how = "fused CPU kernel" if c["kernel"] == "cpu" else "matmul"
        path = ("MHA: one K/V head per query head" if kv_heads == heads else
                f"grouped {how} decode attention: query heads as rows of their K/V head (packed GQA)")
        return {"decode_path": path, "kv_copied": False, "sdpa_calls_per_step": len(calls),
                "sdpa_kv_heads": c["kv_heads"], "decode_kernel": c["kernel"]}
    if kv_heads == heads:
        path, copied = "MHA: one K/V head per query head", False
    elif c["kv_heads"] == heads:
        path, copied = "K/V repeated to all query heads (repeat_kv)", True
    elif c["enable_gqa"]:
        path, copied = "SDPA enable_gqa", False
    elif c["q_heads"] == c["kv_heads"] and c["q_rows"] == heads // kv_heads:
        path, copied = "SDPA with query heads folded per KV head (packed GQA)", False
    else:
        path, copied = f"SDPA saw {c['q_heads']} query heads, {c['kv_heads']} K/V heads", None
    return {"decode_path": path, "kv_copied": copied, "sdpa_calls_per_step": len(calls),
            "sdpa_kv_heads": c["kv_heads"], "decode_kernel": "sdpa"}
