"""The parts of a decode step that are not weight or KV traffic, removed.

What a decode step must do is read every weight once and the filled KV cache once. On
the CPU (fp32, SmolLM2-135M, batch 8, prompt 1024; see docs/decode.md) the profile of
an eager step shows two things on top of that:

- **Weight re-layout inside every matrix multiply.** `nn.Linear` hands the row-major
  weight to the BLAS, which packs it into its own blocked layout on every call: at a few
  rows per call (decode: batch rows) that is a second read and a write of each weight
  per step. `packed_linears` packs each weight once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's weight freezing does) and
  runs the step on the packed copy. At batch 1 the BLAS takes a matrix-vector path that
  does not pack, so packing is only used from batch 2 up.
- **Per-op Python and dispatch cost** (hundreds of small ops per step: norms, rotary,
  masks, cache updates). `torch.compile` removes it; on a GPU, CUDA graphs do.

The attention of one new token reads each KV head once for its query group:
`decode_attention` reshapes the H query heads to [B, G, H/G, D] (the H/G heads of a group
become rows) and multiplies them against the group's [B, G, T, D] keys and values: no
`repeat_kv` copy, no per-call conversion of the boolean mask inside SDPA, and the output
comes out already in the (B, 1, H, D) layout the output projection wants.

On the CPU in fp32 both have a compiled counterpart (`cpu_kernels.cpp`, built on first
use): `packed_linears(..., kernels=...)` multiplies the few rows of a decode step by
weights packed into 48-column panels, streamed once per call (oneDNN's packed weights
reach 16 GB/s at 8 rows on the project's CPU, the panel kernel 20, a matrix-vector
product 25; `bench/bench_cpu_kernels.py`), and `decode_attention(..., fused=True)` is
one pass per group and cache chunk (scores, softmax and weighted values fused; no score
tensor, no separate softmax over it, masked positions never read). Under `torch.compile`
both are called as custom ops (`cpu_kernels.ops()`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


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

    from gqakit.eval import cpu_kernels

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
        from gqakit.eval import cpu_kernels

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


def can_pack(device: Any, dtype: Any) -> bool:
    """oneDNN weight packing: CPU only, fp32 or bf16, and only where torch has oneDNN."""
    import torch

    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


# Rows of input up to which the panel kernel multiplies (a decode step: one per sequence);
# more rows (prefill) go to the BLAS with the plain weight, which is faster there.
SKINNY_MAX_ROWS = 16


@contextlib.contextmanager
def packed_linears(model: Any, batch: int, kernels: Any = None) -> Iterator[int]:
    """Inside: every `nn.Linear` of `model` multiplies by a once-packed copy of its weight.

    Yields the number of extra bytes the packed copies hold (they live as long as the
    context; the original weights are untouched and used again afterwards). The packed
    copy is checked against the plain layer on one input before it is used. `kernels`
    (`cpu_kernels.load()`): fp32 weights go into 48-column panels for the compiled
    small-batch kernel (inputs of up to SKINNY_MAX_ROWS rows); otherwise oneDNN's layout.
    """
    import torch

    from gqakit.eval import cpu_kernels

    if kernels is not None:
        cpu_kernels.ops()  # registered before any compiled step traces a layer
    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    saved: list[tuple[Any, Any]] = []
    extra = 0
    try:
        for m in lin:
            w = m.weight.detach()
            bias = None if m.bias is None else m.bias.detach()
            if kernels is not None and w.dtype == torch.float32 and w.device.type == "cpu":
                packed = kernels.pack_weight(w)

                def fwd(x: Any, _p: Any = packed, _w: Any = w, _b: Any = bias, _k: Any = kernels) -> Any:
                    if x.numel() <= SKINNY_MAX_ROWS * x.shape[-1] and x.dtype == torch.float32:
                        if torch.compiler.is_compiling():
                            return cpu_kernels.ops().panel_linear(x, _p, _w.shape[0], _b)
                        return _k.skinny_linear(x, _p, _w.shape[0], _b)
                    return torch.nn.functional.linear(x, _w, _b)
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, batch)

                def fwd(x: Any, _p: Any = packed, _b: Any = bias) -> Any:
                    return torch.ops.mkldnn._linear_pointwise(x, _p, _b, "none", [], "")

            saved.append((m, m.__dict__.get("forward")))
            m.forward = fwd
            extra += packed.numel() * packed.element_size()
        if lin:
            m = lin[0]
            x = torch.randn(batch, 1, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
            tol = 1e-4 if m.weight.dtype == torch.float32 else 2e-2
            ref = torch.nn.functional.linear(x, m.weight, m.bias)
            if not torch.allclose(m(x), ref, rtol=tol, atol=tol * ref.abs().max().item()):
                raise RuntimeError("packed weights gave other outputs than the plain layer")
        yield extra
    finally:
        for m, fwd in saved:
            if fwd is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = fwd
