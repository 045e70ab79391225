"""One layer's attention weights, read into and written from a canonical head-major form.

Every family's tensors (separate q/k/v/o, GPT-2's transposed fused Conv1D, GPT-NeoX's
per-group fused rows, fused rows in model-parallel blocks) map to the same `AttnHeads`, so the pooling math never sees a
family-specific layout:

    q [H, D, in]    k, v [KV, D, in]    o [out, H, D]    biases [heads, D] or None
    q_norm [H, D], k_norm [KV, D] or None: the weights of a norm over the whole q or k
    projection (`Attention.qk_norm` of scope "projection"), which belong to their heads

`o` is the output projection's weight viewed by input head; its bias is untouched by
every transform and passes through unchanged. `q_order` says which source query head each
query head is, once a grouping has moved them (None: the source order); a family whose
position scheme is bound to the head index (`ArchSpec.position_bias`) records it.

`site` says which attention of a layer: "self" (a decoder's self-attention, the only one
of a decoder-only model), "cross" (an encoder-decoder's cross-attention, in the same
decoder block) or "encoder" (the encoder's self-attention; `shape` is then the encoder's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from gqakit.core.arch import ArchSpec, Attention, Shape
from gqakit.core.qkv_rows import join_grouped_qkv, split_grouped_qkv


@dataclass
class AttnHeads:
    q: Tensor | None  # None: not read (methods that touch only K and V)
    k: Tensor
    v: Tensor
    o: Tensor | None
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    q_order: list[int] | None = None  # source index of each query head; None: unchanged

    @property
    def num_heads(self) -> int:
        return self.q.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[0]

    def replace(self, **changes: Tensor | None) -> "AttnHeads":
        return replace(self, **changes)

    def to(self, dtype: torch.dtype) -> "AttnHeads":
        return AttnHeads(*[None if t is None else t.to(dtype) for t in
                           (self.q, self.k, self.v, self.o, self.q_bias, self.k_bias, self.v_bias,
                            self.q_norm, self.k_norm)],
                         q_order=self.q_order)


SITES = ("self", "cross", "encoder")


def layer_names(spec: ArchSpec, layer: int, site: str = "self") -> dict[str, str]:
    """Role -> tensor name for one layer (weights and possible biases; o's bias excluded; the
    weights of whole-projection q/k norms)."""
    a = spec.attention_at(site)
    p = a.prefix.format(layer=layer)
    roles = {"o.weight": f"{p}{a.o}.weight"}
    parts = ("q", "k", "v") if a.layout == "separate" else ("qkv",)
    for part in parts:
        base = getattr(a, part)
        roles[f"{part}.weight"] = f"{p}{base}.weight"
        roles[f"{part}.bias"] = f"{p}{base}.bias"
    if a.qk_norm is not None and a.qk_norm.scope == "projection":
        for part in ("q", "k"):
            if getattr(a.qk_norm, part):
                roles[f"{part}_norm.weight"] = f"{p}{getattr(a.qk_norm, part)}.weight"
    return roles


def _split_rows(t: Tensor, a: Attention, shape: Shape) -> tuple[Tensor, Tensor, Tensor]:
    """Split a fused qkv output axis (dim 0) into q [H*D...], k [KV*D...], v [KV*D...]."""
    H, KV, D = shape.num_heads, shape.num_kv_heads, shape.head_dim
    if a.layout == "fused_concat":
        return t[: H * D], t[H * D : (H + KV) * D], t[(H + KV) * D :]
    if a.layout == "fused_blocks":
        return _split_blocks(t, a, H, KV, D)
    return split_grouped_qkv(t, H, KV, D)


def _join_rows(q: Tensor, k: Tensor, v: Tensor, a: Attention, H: int, KV: int, D: int) -> Tensor:
    if a.layout == "fused_concat":
        return torch.cat([q, k, v], dim=0)
    if a.layout == "fused_blocks":
        n = a.block_count(KV)
        parts = {"q": q.view(n, H // n * D, *q.shape[1:]), "k": k.view(n, KV // n * D, *k.shape[1:]),
                 "v": v.view(n, KV // n * D, *v.shape[1:])}
        return torch.cat([parts[p] for p in a.order], dim=1).flatten(0, 1)
    return join_grouped_qkv(q, k, v, H, KV, D)


def _split_blocks(t: Tensor, a: Attention, H: int, KV: int, D: int) -> tuple[Tensor, Tensor, Tensor]:
    """fused_blocks rows: `block_count` blocks, each its H/n query, KV/n K and KV/n V heads in
    `a.order`; block b holds query heads b*H/n ... and KV heads b*KV/n ... (head order kept)."""
    n = a.block_count(KV)
    rows = {"q": H // n * D, "k": KV // n * D, "v": KV // n * D}
    blocks = t.reshape(n, -1, *t.shape[1:]).split([rows[p] for p in a.order], dim=1)
    got = {p: b.flatten(0, 1) for p, b in zip(a.order, blocks)}
    return got["q"], got["k"], got["v"]


def read_heads(spec: ArchSpec, shape: Shape, tensors: dict[str, Tensor], layer: int,
               dtype: torch.dtype = torch.float32, *, site: str = "self") -> AttnHeads:
    """Canonical heads from the tensors of one layer (a dict name -> tensor)."""
    names = layer_names(spec, layer, site)
    a = spec.attention_at(site)
    H, KV, D = shape.num_heads, shape.num_kv_heads, shape.head_dim

    def get(role: str) -> Tensor | None:
        t = tensors.get(names[role])
        return None if t is None else t.to(dtype)

    o = get("o.weight")
    if o is not None:
        o = (o.t() if a.transposed else o).reshape(-1, H, D)
    if a.layout == "separate":
        w = {p: get(f"{p}.weight") for p in "qkv"}
        b = {p: get(f"{p}.bias") for p in "qkv"}
    else:
        qkv = get("qkv.weight")
        if a.transposed:
            qkv = qkv.t()
        w = dict(zip("qkv", _split_rows(qkv, a, shape)))
        bias = get("qkv.bias")
        b = dict(zip("qkv", _split_rows(bias, a, shape))) if bias is not None else dict.fromkeys("qkv")
    heads_of = {"q": H, "k": KV, "v": KV}
    norms = {f"{p}_norm": get(f"{p}_norm.weight") if f"{p}_norm.weight" in names else None for p in "qk"}
    return AttnHeads(
        **{p: None if w[p] is None else w[p].reshape(heads_of[p], D, -1) for p in "qkv"}, o=o,
        **{f"{p}_bias": None if b[p] is None else b[p].reshape(heads_of[p], D) for p in "qkv"},
        **{n: None if t is None else t.reshape(heads_of[n[0]], D) for n, t in norms.items()},
    )


def write_heads(spec: ArchSpec, heads: AttnHeads, layer: int, dtypes: dict[str, torch.dtype], *,
                site: str = "self") -> dict[str, Tensor]:
    """Tensors (name -> tensor, in the family's layout) for one layer's canonical heads.

    `dtypes` maps each source tensor name present to its output dtype; absent biases
    stay absent.
    """
    names = layer_names(spec, layer, site)
    a = spec.attention_at(site)
    KV, D = heads.num_kv_heads, heads.k.shape[1]
    out: dict[str, Tensor] = {}
    if heads.o is not None:
        o = heads.o.reshape(heads.o.shape[0], -1)
        out[names["o.weight"]] = o.t() if a.transposed else o
    flat = {p: None if getattr(heads, p) is None else getattr(heads, p).reshape(-1, getattr(heads, p).shape[-1])
            for p in "qkv"}
    bias = {p: getattr(heads, f"{p}_bias") for p in "qkv"}
    for p in "qk":
        norm = getattr(heads, f"{p}_norm")
        if norm is not None and names.get(f"{p}_norm.weight") in dtypes:
            out[names[f"{p}_norm.weight"]] = norm.reshape(-1)
    if a.layout == "separate":
        for p in "qkv":
            if flat[p] is None:
                continue
            out[names[f"{p}.weight"]] = flat[p]
            if names[f"{p}.bias"] in dtypes and bias[p] is not None:
                out[names[f"{p}.bias"]] = bias[p].reshape(-1)
    else:
        H = heads.num_heads
        w = _join_rows(flat["q"], flat["k"], flat["v"], a, H, KV, D)
        out[names["qkv.weight"]] = w.t() if a.transposed else w
        if names["qkv.bias"] in dtypes and bias["q"] is not None:
            out[names["qkv.bias"]] = _join_rows(*(bias[p].reshape(-1) for p in "qkv"), a, H, KV, D)
    return {n: t.to(dtypes[n]).contiguous() for n, t in out.items()}


def output_shapes(spec: ArchSpec, shape: Shape, num_kv_heads: int, layer: int,
                  src_shapes: dict[str, tuple[int, ...]], *, site: str = "self") -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's attention tensors after conversion to `num_kv_heads`."""
    names = layer_names(spec, layer, site)
    transposed = spec.attention_at(site).transposed
    H, G, D = shape.num_heads, num_kv_heads, shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for role, name in names.items():
        if name not in src_shapes:
            continue
        s = list(src_shapes[name])
        part = role.split(".")[0]
        new_rows = {"k": G * D, "v": G * D, "k_norm": G * D, "qkv": (H + 2 * G) * D}.get(part)
        if new_rows is not None:
            axis = 1 if (transposed and role.endswith("weight")) else 0
            s[axis] = new_rows
        shapes[name] = tuple(s)
    return shapes
