"""Weights packed once for the few rows of a decode step.

`nn.Linear` hands the row-major weight to the BLAS, which packs it into its own blocked
layout on every call: at a few rows per call (decode: one row per sequence) that is a
second read and a write of each weight per step. `packed_linears` packs each weight once
and runs the step on the packed copy: into the 48-column panels of gqakit's compiled CPU
kernels (`kernels.py`, fp32, any row count up to `SKINNY_MAX_ROWS`), or else into oneDNN's
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's weight
freezing does). At batch 1 the BLAS takes a matrix-vector path that does not pack, so
the oneDNN layout is only used from batch 2 up.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

def pack_arena(kernels: Any, weights: list[Any]) -> list[Any]:
    """Each [N, K] fp32 weight packed into the compiled kernels' 48-column panels, all back to
    back in one buffer, in the order given (the order a step reads them): 2 MiB-aligned and
    advised as huge pages, so a step streams its weights without gaps or TLB misses, small
    matrices too (a 1-KV-head model's stacked q/k/v)."""
    sizes = [int(kernels.packed_numel(*w.shape)) for w in weights]
    buf, off, packed = kernels.huge_zeros(sum(sizes)), 0, []
    for w, n in zip(weights, sizes):
        packed.append(kernels.pack_weight_into(w, buf[off:off + n]))
        off += n
    return packed


def can_pack(device: Any, dtype: Any) -> bool:
    """oneDNN weight packing: CPU only, fp32 or bf16, and only where torch has oneDNN."""
    import torch

    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


# Rows of input up to which the panel kernel multiplies (a decode step: one per sequence);
# more rows (prefill) go to the BLAS with the plain weight, which is faster there.
SKINNY_MAX_ROWS = 16


@contextlib.contextmanager
def packed_linears(model: Any, batch: int, kernels: Any = None, order: list[Any] | None = None) -> Iterator[int]:
    """Inside: every `nn.Linear` of `model` multiplies by a once-packed copy of its weight.

    Yields the number of extra bytes the packed copies hold (they live as long as the
    context; the original weights are untouched and used again afterwards). The packed
    copy is checked against the plain layer on one input before it is used. `kernels`
    (`cpu_kernels.load()`): fp32 weights go into 48-column panels for the compiled
    small-batch kernel (inputs of up to SKINNY_MAX_ROWS rows); otherwise oneDNN's layout.
    `order` (with `kernels`): the linear layers in the order a decode step reads them; their
    panels then lie back to back in one buffer on huge pages, in that order (as the fused
    decoder-only layers' do), so a step streams its weights without gaps or TLB misses.
    """
    import torch

    from gqakit.runtime import kernels as cpu_kernels

    if kernels is not None:
        cpu_kernels.ops()  # registered before any compiled step traces a layer
    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    into: dict[int, Any] = {}
    if kernels is not None and order:
        ids = {id(m) for m in lin}
        arena = [m for m in dict.fromkeys(order) if id(m) in ids and m.weight.dtype == torch.float32
                 and m.weight.device.type == "cpu"]
        sizes = [int(kernels.packed_numel(*m.weight.shape)) for m in arena]
        buf, off = kernels.huge_zeros(sum(sizes)), 0
        for m, n in zip(arena, sizes):
            into[id(m)], off = buf[off:off + n], off + n
    saved: list[tuple[Any, Any]] = []
    extra = 0
    try:
        for m in lin:
            w = m.weight.detach()
            bias = None if m.bias is None else m.bias.detach()
            if kernels is not None and w.dtype == torch.float32 and w.device.type == "cpu":
                packed = kernels.pack_weight_into(w, into[id(m)]) if id(m) in into else kernels.pack_weight(w)

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
