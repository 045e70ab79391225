"""Which decoder layers the fused CPU decode step computes, and what it needs of each.

`layout_problem(model)` says why a model's layers do not have a layout `decode_layer`
(`cpu_kernels.cpp`) computes, or None; `layer_specs(model)` collects, per layer, the four
matrices to pack (q/k/v stacked, output, the MLP's up (or gate/up stacked) and down), their
biases, norms, head count and activation, and for the stack the embedding, rotary module,
final norm and residual wiring. Which layout's check and collection a model gets is its
architecture table entry's `decode` (`core/arch.py`; a model whose family is not in the table
is tried as the Llama layout, and none where the entry names none); whether the model has
that layout is then read from its loaded modules: Llama-layout models (RMSNorm, or OLMo's
LayerNorm without parameters and its clip_qkv, or StableLM's LayerNorms; q/k/v/o projections
or Phi-3's stacked ones; per-head q/k RMSNorms as Qwen3 has, or none; gate/up/down MLP with
SiLU or tanh-GELU and no biases; full attention), GPT-NeoX, GPT-2, OPT and Phi. The stack
holding the decoder blocks is found where the entry's `block` says it is.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gqakit.core.loaded import find_loaded
from gqakit.core.qkv_rows import split_grouped_qkv

# The layout tried for a model whose family is not in the architecture table: the Llama
# layout's structure check decides, as for any entry that names it.
FALLBACK_LAYOUT = "llama"


def _norm(module: Any) -> tuple[int, Any, Any, float] | None:
    """(norm_kind for `decode_layer`, weight, bias, eps) of a decoder layer's norm, or None: an
    RMSNorm (0; Gemma's, which scales by 1 + weight, with that sum as its weight), OLMo's
    LayerNorm without parameters (1, eps 1e-5 as its forward hard-codes; the check before use
    would catch a change), or a LayerNorm with weight and bias (2)."""
    import torch

    name = type(module).__name__
    if name == "GemmaRMSNorm" and hasattr(module, "eps"):
        return 0, (1.0 + module.weight.detach().float()), None, float(module.eps)
    if "RMSNorm" in name and hasattr(module, "variance_epsilon") and getattr(module, "weight", None) is not None:
        return 0, module.weight.detach(), None, float(module.variance_epsilon)
    if name == "OlmoLayerNorm" and not list(module.parameters()):
        return 1, torch.empty(0), None, 1e-5
    if isinstance(module, torch.nn.LayerNorm) and module.weight is not None and module.bias is not None:
        return 2, module.weight.detach(), module.bias.detach(), float(module.eps)
    return None


# MLP activation module (class name) -> decode_layer's mlp_kind for a gate/up/down MLP
_GATED = {"SiLU": 0, "SiLUActivation": 0, "GELUTanh": 4, "PytorchGELUTanh": 4}


def _linears(module: Any, names: tuple[str, ...]) -> bool:
    """Whether `module` has an `nn.Linear` under each of `names`."""
    import torch

    return module is not None and all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in names)


def _affine_norms_problem(layer: Any, names: tuple[str, ...]) -> str | None:
    """Why the named norms of `layer` are not all LayerNorms with weight and bias, or None."""
    for n in names:
        got = _norm(getattr(layer, n, None))
        if got is None or got[0] != 2:
            return f"{n} is not a LayerNorm with weight and bias"
    return None


def _layout(model: Any) -> tuple[str | None, Any]:
    """(the `decode` layout of `model`'s table entry, the module holding its decoder blocks)."""
    spec = find_loaded(model)
    if spec is None:
        return FALLBACK_LAYOUT, getattr(model, "model", None)
    stack = spec.blocks.rpartition(".")[0]
    try:
        return spec.decode, model.get_submodule(stack) if stack else model
    except AttributeError:
        return spec.decode, None


def _layout_problem(model: Any) -> str | None:
    """Why `model`'s decoder layers do not have a layout `decode_layer` computes, or None."""
    import torch

    layout, inner = _layout(model)
    if layout not in _PROBLEMS:
        return f"its architecture table entry names no decoder-layer layout of the fused step ({layout})"
    why = _PROBLEMS[layout](model, inner)
    if why is None and any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return "not an fp32 CPU model"
    return why


def _neox_problem(model: Any, inner: Any) -> str | None:
    """GPT-NeoX (Pythia, and gqakit's grouped version of it): LayerNorms with biases, one
    query_key_value projection, partial rotary, GELU MLP with biases, parallel or sequential
    residuals."""
    import torch

    if getattr(inner, "rotary_emb", None) is None or not isinstance(getattr(inner, "final_layer_norm", None), torch.nn.LayerNorm):
        return "GPT-NeoX stack without rotary embeddings or a final LayerNorm"
    if model.config.hidden_act != "gelu":
        return f"MLP activation {model.config.hidden_act!r} (only exact GELU is fused)"
    for layer in inner.layers:
        att, mlp = layer.attention, layer.mlp
        if not _linears(att, ("query_key_value", "dense")):
            return "attention without query_key_value / dense projections"
        if not _linears(mlp, ("dense_h_to_4h", "dense_4h_to_h")):
            return "MLP without dense_h_to_4h / dense_4h_to_h"
        why = _affine_norms_problem(layer, ("input_layernorm", "post_attention_layernorm"))
        if why:
            return why
    return None


_GELU = {"gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2}  # activation -> decode_layer's mlp_kind


def _gpt2_problem(model: Any, inner: Any) -> str | None:
    """GPT-2 (and gqakit's grouped GPT-2): learned positions, LayerNorms with biases, Conv1D
    projections (c_attn: queries, keys, values side by side), GELU MLP, sequential residuals."""
    cfg = model.config
    if not all(hasattr(inner, n) for n in ("h", "wte", "wpe", "ln_f")) or getattr(cfg, "add_cross_attention", False):
        return "not a GPT-2 stack (transformer.h, wte, wpe, ln_f) without cross-attention"
    if cfg.activation_function not in _GELU:
        return f"MLP activation {cfg.activation_function!r} (only GELU is fused)"
    for block in inner.h:
        why = _affine_norms_problem(block, ("ln_1", "ln_2"))
        if why:
            return why
        convs = [getattr(block.attn, "c_attn", None), getattr(block.attn, "c_proj", None),
                 getattr(block.mlp, "c_fc", None), getattr(block.mlp, "c_proj", None)]
        if not all(type(c).__name__ == "Conv1D" for c in convs):
            return "projections other than Conv1D c_attn / c_proj / c_fc"
    return None


def _opt_problem(model: Any, dec: Any) -> str | None:
    """OPT (and gqakit's grouped OPT): learned positions (offset 2), pre-norm LayerNorms, biased
    q/k/v/out projections, ReLU MLP. The 350M variant (post-norm, project_in/out) is not fused."""
    cfg = model.config
    if dec is None or not hasattr(dec, "layers"):
        return "no OPT decoder stack where the architecture table's block says"
    if not cfg.do_layer_norm_before or dec.project_in is not None or dec.project_out is not None:
        return "OPT with norms after the blocks or projections in/out (opt-350m's layout)"
    if dec.final_layer_norm is None or cfg.activation_function != "relu":
        return "OPT without a final LayerNorm or with an activation other than ReLU"
    for layer in dec.layers:
        att = layer.self_attn
        if not _linears(att, ("q_proj", "k_proj", "v_proj", "out_proj")):
            return "attention without q/k/v/out projections"
        why = _affine_norms_problem(layer, ("self_attn_layer_norm", "final_layer_norm"))
        if why:
            return why
    return None


def _phi_problem(model: Any, inner: Any) -> str | None:
    """Phi (-1, -1.5, -2): one LayerNorm per block feeding attention and MLP side by side, biased
    q/k/v/dense projections, partial rotary, a GELU MLP with biases."""
    cfg = model.config
    if cfg.hidden_act not in _GELU or getattr(cfg, "qk_layernorm", False):
        return "Phi with q/k LayerNorms or an activation other than GELU"
    if _affine_norms_problem(inner, ("final_layernorm",)):
        return "final_layernorm is not a LayerNorm with weight and bias"
    for layer in inner.layers:
        att, mlp = layer.self_attn, layer.mlp
        if not _linears(att, ("q_proj", "k_proj", "v_proj", "dense")):
            return "attention without q/k/v/dense projections"
        if not _linears(mlp, ("fc1", "fc2")):
            return "MLP without fc1 / fc2"
        why = _affine_norms_problem(layer, ("input_layernorm",))
        if why:
            return why
    return None


def _llama_problem(model: Any, inner: Any) -> str | None:
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or getattr(inner, "norm", None) is None:
        return "not a decoder stack with .model.layers, .rotary_emb and .norm"
    cfg = model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) is not False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])) or window:
        return "sliding-window layers"
    kinds = set()
    for layer in layers:
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (_linears(att, ("q_proj", "k_proj", "v_proj", "o_proj")) or _linears(att, ("qkv_proj", "o_proj"))):
            return "attention without q/k/v/o (or Phi-3's qkv/o) projections"
        qn, kn = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
        if (qn is None) != (kn is None):
            return "a q norm without a k norm, or the reverse"
        if qn is not None and not all("RMSNorm" in type(n).__name__ and hasattr(n, "variance_epsilon")
                                      and n.weight.shape == (att.head_dim,) for n in (qn, kn)):
            return "q/k norms other than a per-head RMSNorm"
        names = next((n for n in (("gate_proj", "up_proj", "down_proj"), ("gate_up_proj", "down_proj"))
                      if _linears(mlp, n)), None)
        if names is None:
            return "MLP without gate/up/down (or Phi-3's gate_up/down) projections"
        if any(getattr(mlp, n).bias is not None for n in names):
            return "MLP biases"
        if type(getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))).__name__ not in _GATED:
            return "MLP activation other than SiLU or tanh-GELU"
        if getattr(att, "qk_layernorm", False):
            return "per-head q/k LayerNorms"
        parallel = getattr(cfg, "use_parallel_residual", False)  # StableLM: one norm for both branches
        for n in ("input_layernorm",) + (() if parallel else ("post_attention_layernorm",)):
            got = _norm(getattr(layer, n, None))
            if got is None:
                return f"{n} is neither an RMSNorm nor a LayerNorm"
            kinds.add(got[0])
    if _norm(inner.norm) is None:
        return "final norm is neither an RMSNorm nor a LayerNorm"
    if len(kinds) > 1:
        return "layers with different norms"
    return None


def _llama_layers(model: Any, inner: Any) -> SimpleNamespace:
    """What FusedDecode needs of a Llama-layout model: the stack's modules, and per layer the
    four matrices to pack (rows, columns, the matrix when asked for: stacked copies are made one
    at a time) and the rest of `decode_layer`'s arguments."""
    import torch

    cfg = model.config.get_text_config(decoder=True)
    parallel = bool(getattr(cfg, "use_parallel_residual", False))
    layers = []
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        # Phi-3 has q/k/v and gate/up as one projection each, already stacked as decode_layer reads them
        qkv = (a.qkv_proj,) if hasattr(a, "qkv_proj") else (a.q_proj, a.k_proj, a.v_proj)
        gu = (m.gate_up_proj,) if hasattr(m, "gate_up_proj") else (m.gate_proj, m.up_proj)
        bias = [x.bias for x in qkv]
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        kind, ln1, ln1b, eps1 = _norm(layer.input_layernorm)
        _, ln2, ln2b, eps2 = (kind, ln1, ln1b, eps1) if parallel else _norm(layer.post_attention_layernorm)
        layers.append(SimpleNamespace(
            mats=[(sum(x.out_features for x in qkv), qkv[0].in_features,
                   lambda qkv=qkv: torch.cat([x.weight for x in qkv]).detach()),
                  (*a.o_proj.weight.shape, a.o_proj.weight.detach),
                  (sum(x.out_features for x in gu), gu[0].in_features,
                   lambda gu=gu: torch.cat([x.weight for x in gu]).detach()),
                  (*m.down_proj.weight.shape, m.down_proj.weight.detach)],
            bqkv=None if all(b is None for b in bias) else torch.cat(
                [b.detach() if b is not None else torch.zeros(x.out_features) for b, x in zip(bias, qkv)]),
            bo=None if a.o_proj.bias is None else a.o_proj.bias.detach(), bup=None, bdown=None,
            norm_kind=kind, ln1=ln1, ln1b=ln1b, eps1=eps1, ln2=ln2, ln2b=ln2b, eps2=eps2,
            qnorm=None if qn is None else qn.weight.detach(), knorm=None if kn is None else kn.weight.detach(),
            qk_eps=float(qn.variance_epsilon) if qn is not None else 0.0,
            heads=cfg.num_attention_heads, inter=m.down_proj.in_features,
            mlp_kind=_GATED[type(getattr(m, "act_fn", getattr(m, "activation_fn", None))).__name__],
            scale=float(getattr(a, "scaling", a.head_dim ** -0.5))))
    # (Gemma's embedding module scales by sqrt(hidden) itself; were that in the model's forward,
    # as in older transformers, the check would refuse this step)
    return SimpleNamespace(embed=lambda ids, pos: inner.embed_tokens(ids), rotary=inner.rotary_emb,
                           final=inner.norm, layers=layers,
                           clip_qkv=float(getattr(cfg, "clip_qkv", None) or 0.0),  # OLMo: q/k/v clamped
                           parallel=parallel)


def _neox_layers(model: Any, inner: Any) -> SimpleNamespace:
    """`_llama_layers` for GPT-NeoX. Its query_key_value rows are, per K/V group g, the group's
    H/G query heads, then its key head, then its value head ((G, H/G + 2, D); stock Pythia is
    G = H: (H, 3, D)); they are re-stacked as all queries, all keys, all values."""
    import torch

    cfg = model.config
    H = cfg.num_attention_heads
    D = cfg.hidden_size // H

    def restack(t: Any, G: int) -> Any:  # grouped rows -> all queries, all keys, all values
        return torch.cat(split_grouped_qkv(t.detach(), H, G, D))

    layers = []
    for layer in inner.layers:
        a, m = layer.attention, layer.mlp
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        qkv = a.query_key_value
        G = (qkv.out_features // D - H) // 2  # this layer's K/V heads: rows (H + 2G) D
        layers.append(SimpleNamespace(
            mats=[(*qkv.weight.shape, lambda qkv=qkv, G=G: restack(qkv.weight, G)),
                  (*a.dense.weight.shape, a.dense.weight.detach),
                  (*m.dense_h_to_4h.weight.shape, m.dense_h_to_4h.weight.detach),
                  (*m.dense_4h_to_h.weight.shape, m.dense_4h_to_h.weight.detach)],
            bqkv=None if qkv.bias is None else restack(qkv.bias, G),
            bo=None if a.dense.bias is None else a.dense.bias.detach(),
            bup=None if m.dense_h_to_4h.bias is None else m.dense_h_to_4h.bias.detach(),
            bdown=None if m.dense_4h_to_h.bias is None else m.dense_4h_to_h.bias.detach(),
            norm_kind=2, ln1=n1.weight.detach(), ln1b=n1.bias.detach(), eps1=float(n1.eps),
            ln2=n2.weight.detach(), ln2b=n2.bias.detach(), eps2=float(n2.eps),
            qnorm=None, knorm=None, qk_eps=0.0, heads=H, inter=m.dense_h_to_4h.out_features, mlp_kind=1,
            scale=float(getattr(a, "scaling", D ** -0.5))))
    return SimpleNamespace(embed=lambda ids, pos: inner.embed_in(ids), rotary=inner.rotary_emb,
                           final=inner.final_layer_norm, layers=layers, clip_qkv=0.0,
                           parallel=bool(cfg.use_parallel_residual))


def _biased_layer(qkv: tuple, o: Any, up: Any, down: Any, n1: Any, n2: Any, heads: int, mlp_kind: int,
                  scale: float) -> SimpleNamespace:
    """A layer entry for the families with separate q/k/v, output, up and down `nn.Linear`s (biases
    where present), LayerNorms with weight and bias, and an ungated MLP (OPT, Phi)."""
    import torch

    def bias(x: Any) -> Any:
        return None if x.bias is None else x.bias.detach()

    return SimpleNamespace(
        mats=[(sum(x.out_features for x in qkv), qkv[0].in_features,
               lambda: torch.cat([x.weight for x in qkv]).detach()),
              (*o.weight.shape, o.weight.detach), (*up.weight.shape, up.weight.detach),
              (*down.weight.shape, down.weight.detach)],
        bqkv=None if qkv[0].bias is None else torch.cat([x.bias for x in qkv]).detach(),
        bo=bias(o), bup=bias(up), bdown=bias(down),
        norm_kind=2, ln1=n1.weight.detach(), ln1b=n1.bias.detach(), eps1=float(n1.eps),
        ln2=n2.weight.detach(), ln2b=n2.bias.detach(), eps2=float(n2.eps),
        qnorm=None, knorm=None, qk_eps=0.0, heads=heads, inter=up.out_features, mlp_kind=mlp_kind, scale=scale)


def _opt_layers(model: Any, dec: Any) -> SimpleNamespace:
    """`_llama_layers` for OPT (pre-norm): q/k/v stacked, ReLU MLP, position embeddings offset by 2."""
    cfg = model.config
    layers = [_biased_layer((x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj), x.self_attn.out_proj,
                            x.fc1, x.fc2, x.self_attn_layer_norm, x.final_layer_norm, cfg.num_attention_heads, 3,
                            float(x.self_attn.scaling)) for x in dec.layers]
    return SimpleNamespace(embed=lambda ids, pos: dec.embed_tokens(ids) + dec.embed_positions(None, 0, position_ids=pos),
                           rotary=None, final=dec.final_layer_norm, layers=layers, clip_qkv=0.0, parallel=False)


def _phi_layers(model: Any, inner: Any) -> SimpleNamespace:
    """`_llama_layers` for Phi: q/k/v stacked, the block's one LayerNorm for both branches
    (decode_layer's parallel residual with norm 2 = norm 1), GELU MLP, biases everywhere."""
    cfg = model.config
    layers = [_biased_layer((x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj), x.self_attn.dense,
                            x.mlp.fc1, x.mlp.fc2, x.input_layernorm, x.input_layernorm, cfg.num_attention_heads,
                            _GELU[cfg.hidden_act], float(x.self_attn.scaling)) for x in inner.layers]
    return SimpleNamespace(embed=lambda ids, pos: inner.embed_tokens(ids), rotary=inner.rotary_emb,
                           final=inner.final_layernorm, layers=layers, clip_qkv=0.0, parallel=True)


def _gpt2_layers(model: Any, inner: Any) -> SimpleNamespace:
    """`_llama_layers` for GPT-2: Conv1D weights are [in, out], so each matrix is transposed as
    it is packed; c_attn's outputs are already all queries, then keys, then values."""
    cfg = model.config
    layers = []
    for block in inner.h:
        a, m = block.attn, block.mlp
        layers.append(SimpleNamespace(
            mats=[(c.weight.shape[1], c.weight.shape[0], lambda c=c: c.weight.detach().t())
                  for c in (a.c_attn, a.c_proj, m.c_fc, m.c_proj)],
            bqkv=a.c_attn.bias.detach(), bo=a.c_proj.bias.detach(), bup=m.c_fc.bias.detach(),
            bdown=m.c_proj.bias.detach(), norm_kind=2,
            ln1=block.ln_1.weight.detach(), ln1b=block.ln_1.bias.detach(), eps1=float(block.ln_1.eps),
            ln2=block.ln_2.weight.detach(), ln2b=block.ln_2.bias.detach(), eps2=float(block.ln_2.eps),
            qnorm=None, knorm=None, qk_eps=0.0, heads=cfg.num_attention_heads, inter=m.c_fc.weight.shape[1],
            mlp_kind=_GELU[cfg.activation_function], scale=float(a.scaling)))
    return SimpleNamespace(embed=lambda ids, pos: inner.wte(ids) + inner.wpe(pos), rotary=None, final=inner.ln_f,
                           layers=layers, clip_qkv=0.0, parallel=False)


# A table entry's `decode` layout -> (why a model's layers lack it, or None; what the fused step
# needs of them). The keys are layout names (core.arch.DecodeLayout), which several families share.
_PROBLEMS = {"llama": _llama_problem, "gpt_neox": _neox_problem, "gpt2": _gpt2_problem, "opt": _opt_problem,
             "phi": _phi_problem}
_LAYERS = {"llama": _llama_layers, "gpt_neox": _neox_layers, "gpt2": _gpt2_layers, "opt": _opt_layers,
           "phi": _phi_layers}


def layout_problem(model: Any) -> str | None:
    """Why `model`'s decoder layers do not have a layout `decode_layer` computes, or None."""
    return _layout_problem(model)


def layer_specs(model: Any) -> SimpleNamespace:
    """The stack (`embed`, `rotary`, `final`, `clip_qkv`, `parallel`) and per layer what
    `decode_layer` takes (`layers`: `mats` to pack, biases, norms, heads, MLP kind, scale),
    for a model `layout_problem` accepts."""
    layout, inner = _layout(model)
    return _LAYERS[layout](model, inner)
