"""A CPU decode step with one compiled call per decoder layer (Llama-layout, Phi, GPT-NeoX, GPT-2, OPT; fp32).

What is left of an eager decode step once the weights and the KV cache stream at memory
speed (`cpu_kernels.cpp`'s panel GEMM and fused attention) is per-op cost: transformers
runs a layer as ~60 small ops and module calls (RMSNorm as six ops, rotary as seven per
tensor, the cache update, reshapes, the SiLU gate), about 5 ms of SmolLM2-135M's 21-26 ms
step at batch 8 on the project's CPU (`bench/profile_decode.py`). `FusedDecode` runs each
layer as one call of `decode_layer` (norm, one GEMM for q/k/v stacked, rotary, the cache
write, grouped attention, output projection, norm, one GEMM for gate/up stacked, SiLU
gate, down projection, both residual adds), then the final norm and the LM head.

It applies where a model's layers have that layout (RMSNorm modules, or OLMo's LayerNorm
without parameters and its clip_qkv; q/k/v/o projections; per-head q/k RMSNorms, as Qwen3
has, or none; gate/up/down MLP with SiLU and no biases; full attention), or GPT-NeoX's
(`_neox_layers`), GPT-2's (`_gpt2_layers`), OPT's (`_opt_layers`) or Phi's (`_phi_layers`),
and it is checked
before use: one decode step from the same cache, fused and plain, must give the
same logits and write the same cache slot (`check`); otherwise the plain step runs and
`why_not` says why. Used only for decode steps without a padding mask (the speed
benchmark's); prefill stays transformers' own.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


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


def _layout_problem(model: Any) -> str | None:
    """Why `model`'s decoder layers do not have a layout `decode_layer` computes, or None."""
    import torch

    inner = getattr(model, "model", None)
    why = (_neox_problem(model) if hasattr(model, "gpt_neox") else _gpt2_problem(model) if hasattr(model, "transformer")
           else _opt_problem(model) if hasattr(inner, "decoder") else _phi_problem(model) if hasattr(inner, "final_layernorm")
           else _llama_problem(model))
    if why is None and any(p.dtype != torch.float32 or p.device.type != "cpu" for p in model.parameters()):
        return "not an fp32 CPU model"
    return why


def _neox_problem(model: Any) -> str | None:
    """GPT-NeoX (Pythia, and gqakit's grouped version of it): LayerNorms with biases, one
    query_key_value projection, partial rotary, GELU MLP with biases, parallel or sequential
    residuals."""
    import torch

    inner = model.gpt_neox
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


def _gpt2_problem(model: Any) -> str | None:
    """GPT-2 (and gqakit's grouped GPT-2): learned positions, LayerNorms with biases, Conv1D
    projections (c_attn: queries, keys, values side by side), GELU MLP, sequential residuals."""
    inner = model.transformer
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


def _opt_problem(model: Any) -> str | None:
    """OPT (and gqakit's grouped OPT): learned positions (offset 2), pre-norm LayerNorms, biased
    q/k/v/out projections, ReLU MLP. The 350M variant (post-norm, project_in/out) is not fused."""
    cfg, dec = model.config, model.model.decoder
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


def _phi_problem(model: Any) -> str | None:
    """Phi (-1, -1.5, -2): one LayerNorm per block feeding attention and MLP side by side, biased
    q/k/v/dense projections, partial rotary, a GELU MLP with biases."""
    cfg, inner = model.config, model.model
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


def _llama_problem(model: Any) -> str | None:
    inner = getattr(model, "model", None)
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


def _llama_layers(model: Any) -> SimpleNamespace:
    """What FusedDecode needs of a Llama-layout model: the stack's modules, and per layer the
    four matrices to pack (rows, columns, the matrix when asked for: stacked copies are made one
    at a time) and the rest of `decode_layer`'s arguments."""
    import torch

    inner = model.model
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


def _neox_layers(model: Any) -> SimpleNamespace:
    """`_llama_layers` for GPT-NeoX. Its query_key_value rows are, per K/V group g, the group's
    H/G query heads, then its key head, then its value head ((G, H/G + 2, D); stock Pythia is
    G = H: (H, 3, D)); they are re-stacked as all queries, all keys, all values."""
    import torch

    cfg = model.config
    inner = model.gpt_neox
    H = cfg.num_attention_heads
    D = cfg.hidden_size // H
    G = (inner.layers[0].attention.query_key_value.out_features // D - H) // 2  # rows: (H + 2G) D
    R = H // G

    def restack(t: Any) -> Any:  # rows (G, R + 2, D, ...) -> queries (G R D), keys (G D), values (G D)
        v, rest = t.detach().reshape(G, R + 2, D, *t.shape[1:]), t.shape[1:]
        return torch.cat([v[:, :R].reshape(-1, *rest), v[:, R].reshape(-1, *rest), v[:, R + 1].reshape(-1, *rest)])

    layers = []
    for layer in inner.layers:
        a, m = layer.attention, layer.mlp
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        qkv = a.query_key_value
        layers.append(SimpleNamespace(
            mats=[(*qkv.weight.shape, lambda qkv=qkv: restack(qkv.weight)),
                  (*a.dense.weight.shape, a.dense.weight.detach),
                  (*m.dense_h_to_4h.weight.shape, m.dense_h_to_4h.weight.detach),
                  (*m.dense_4h_to_h.weight.shape, m.dense_4h_to_h.weight.detach)],
            bqkv=None if qkv.bias is None else restack(qkv.bias),
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


def _opt_layers(model: Any) -> SimpleNamespace:
    """`_llama_layers` for OPT (pre-norm): q/k/v stacked, ReLU MLP, position embeddings offset by 2."""
    cfg, dec = model.config, model.model.decoder
    layers = [_biased_layer((x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj), x.self_attn.out_proj,
                            x.fc1, x.fc2, x.self_attn_layer_norm, x.final_layer_norm, cfg.num_attention_heads, 3,
                            float(x.self_attn.scaling)) for x in dec.layers]
    return SimpleNamespace(embed=lambda ids, pos: dec.embed_tokens(ids) + dec.embed_positions(None, 0, position_ids=pos),
                           rotary=None, final=dec.final_layer_norm, layers=layers, clip_qkv=0.0, parallel=False)


def _phi_layers(model: Any) -> SimpleNamespace:
    """`_llama_layers` for Phi: q/k/v stacked, the block's one LayerNorm for both branches
    (decode_layer's parallel residual with norm 2 = norm 1), GELU MLP, biases everywhere."""
    cfg, inner = model.config, model.model
    layers = [_biased_layer((x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj), x.self_attn.dense,
                            x.mlp.fc1, x.mlp.fc2, x.input_layernorm, x.input_layernorm, cfg.num_attention_heads,
                            _GELU[cfg.hidden_act], float(x.self_attn.scaling)) for x in inner.layers]
    return SimpleNamespace(embed=lambda ids, pos: inner.embed_tokens(ids), rotary=inner.rotary_emb,
                           final=inner.final_layernorm, layers=layers, clip_qkv=0.0, parallel=True)


def _gpt2_layers(model: Any) -> SimpleNamespace:
    """`_llama_layers` for GPT-2: Conv1D weights are [in, out], so each matrix is transposed as
    it is packed; c_attn's outputs are already all queries, then keys, then values."""
    cfg = model.config
    inner = model.transformer
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


class FusedDecode:
    """`model`'s decode step as one `decode_layer` call per layer (see the module docstring).

    Called like the model for one decode step: `step(input_ids=[B, 1], cache=..., position_ids=[1, 1])`
    (or `past_key_values=`), returns an object with `.logits` [B, 1, vocab].
    """

    def __init__(self, model: Any, kernels: Any, arena: bool = True) -> None:
        self.model, self.k = model, kernels
        spec = (_neox_layers(model) if hasattr(model, "gpt_neox") else _gpt2_layers(model) if hasattr(model, "transformer")
                else _opt_layers(model) if hasattr(model.model, "decoder")
                else _phi_layers(model) if hasattr(model.model, "final_layernorm") else _llama_layers(model))
        self.embed, self.rotary, self.final = spec.embed, spec.rotary, spec.final
        self.clip_qkv, self.parallel = spec.clip_qkv, spec.parallel
        head = model.get_output_embeddings()
        # every matrix the step streams, packed into one buffer in the order the step reads them
        # (2 MiB-aligned, advised as huge pages: small matrices too, e.g. a 1-KV-head model's
        # stacked q/k/v, sit on huge pages, and the stream has no gaps)
        mats = [m for e in spec.layers for m in e.mats] + [(*head.weight.shape, head.weight.detach)]
        if arena:
            sizes = [int(kernels.packed_numel(n, k)) for n, k, _ in mats]
            buf = kernels.huge_zeros(sum(sizes))
            packed, off = [], 0
            for (_, _, w), n in zip(mats, sizes):
                packed.append(kernels.pack_weight_into(w(), buf[off:off + n]))
                off += n
        else:
            packed = [kernels.pack_weight(w()) for _, _, w in mats]
        self.packed_bytes = sum(t.numel() * 4 for t in packed)
        self.layers = spec.layers
        for i, e in enumerate(self.layers):
            e.wqkv, e.wo, e.wgu, e.wd = packed[4 * i: 4 * i + 4]
            del e.mats
        self.head = packed[-1]
        self.head_bias = None if getattr(head, "bias", None) is None else head.bias.detach()
        self.vocab = head.weight.shape[0]

    def __call__(self, input_ids: Any, cache: Any = None, past_key_values: Any = None, position_ids: Any = None,
                 **_: Any) -> Any:
        import torch

        cache = cache if cache is not None else past_key_values
        b = input_ids.shape[0]
        x = self.embed(input_ids, position_ids)  # [B, 1, hidden]
        if self.rotary is None:  # learned positions (GPT-2): no rotary
            cos = sin = torch.empty(1, 0)
        else:
            cos, sin = self.rotary(x, position_ids)  # [1, 1, D] (or [B, 1, D])
            cos, sin = cos.reshape(-1, cos.shape[-1]).contiguous(), sin.reshape(-1, sin.shape[-1]).contiguous()
        x = x.reshape(b, -1).contiguous()
        first = cache.layers[0]
        slot = int(first.cumulative_length)
        t = first.keys.shape[2]
        mask = torch.zeros(b, t)
        mask[:, slot + 1:] = float("-inf")  # causal: this token and everything before it
        for e, layer in zip(self.layers, cache.layers):
            x = self.k.decode_layer(x, e.ln1, e.eps1, e.wqkv, e.bqkv, e.wo, e.bo, e.ln2, e.eps2, e.wgu, e.wd,
                                    cos, sin, layer.keys, layer.values, slot, mask, e.scale, e.heads, e.inter,
                                    e.qnorm, e.knorm, e.qk_eps, e.norm_kind, self.clip_qkv, e.ln1b, e.ln2b,
                                    e.mlp_kind, e.bup, e.bdown, self.parallel)
            layer.cumulative_length.add_(1)
        x = self.final(x)
        logits = self.k.skinny_linear(x, self.head, self.vocab, self.head_bias)
        return SimpleNamespace(logits=logits.reshape(b, 1, self.vocab))


# How far apart the fused and the plain step may be: the relative error ||got - ref|| / ||ref||
# of the logits and of each layer's new cache entries. Both steps are fp32 with other summation
# orders, and the difference grows through the residual stream: on SmolLM2-135M's 3->1
# conversion (30 layers), over 60 prompts, up to 1.3e-4 for the logits and 8.4e-5 for the
# deepest layers' cache entries, where an element-wise 1e-4 bound refused 12 of the 60
# (bench/fused_check_errors.py). A wrong slot, norm, rotary or head map is off by 1e-2 or more.
REL_TOL = 1e-3


def _rel(got: Any, ref: Any) -> float:
    """||got - ref|| / ||ref|| (0 when both are zero)."""
    den = ref.double().norm().item()
    num = (got.double() - ref.double()).norm().item()
    return num / den if den > 0 else num


def both_steps(model: Any, step: FusedDecode, cache_factory: Any, vocab: int, cache_kw: str = "past_key_values",
               seed: int = 0) -> SimpleNamespace:
    """One decode step of the model and of `step` from two equally prefilled caches (a seeded
    prompt of 2 x 5 tokens): `ref`/`got` logits, `ref_cache`/`got_cache`, and `p`, the slot written."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        b, p = 2, 5
        prompt = torch.randint(0, vocab, (b, p), generator=gen)
        caches = []
        for _ in range(2):
            c = cache_factory(b, p + 2)
            model(input_ids=prompt, **{cache_kw: c}, position_ids=torch.arange(p).unsqueeze(0), use_cache=True)
            caches.append(c)
        tok = torch.randint(0, vocab, (b, 1), generator=gen)
        pos = torch.full((1, 1), p)
        ref = model(input_ids=tok, **{cache_kw: caches[0]}, position_ids=pos, use_cache=True).logits[:, -1]
        got = step(input_ids=tok, past_key_values=caches[1], position_ids=pos).logits[:, -1]
    return SimpleNamespace(ref=ref, got=got, ref_cache=caches[0], got_cache=caches[1], p=p)


def check(model: Any, step: FusedDecode, cache_factory: Any, vocab: int, cache_kw: str = "past_key_values",
          seed: int = 0) -> str | None:
    """One decode step both ways from the same prefilled cache: None if they agree, else why not.

    Deterministic (a seeded prompt), so a model gets the same verdict in every run.
    """
    return verdict(both_steps(model, step, cache_factory, vocab, cache_kw, seed))


def verdict(r: SimpleNamespace) -> str | None:
    """`check`'s judgement of a `both_steps` result: None if the steps agree, else why not."""
    import torch

    p = r.p
    err = _rel(r.got, r.ref)
    if not err <= REL_TOL:
        return f"fused layers gave other logits than the model (relative error {err:.2g})"
    for i, (la, lb) in enumerate(zip(r.ref_cache.layers, r.got_cache.layers)):
        err = max(_rel(lb.keys[:, :, p], la.keys[:, :, p]), _rel(lb.values[:, :, p], la.values[:, :, p]))
        untouched = torch.equal(la.keys[:, :, p + 1:], lb.keys[:, :, p + 1:]) and torch.equal(
            la.values[:, :, p + 1:], lb.values[:, :, p + 1:])
        if not (err <= REL_TOL and untouched and int(la.cumulative_length) == int(lb.cumulative_length)):
            return f"fused layers wrote another cache slot than the model (layer {i}, relative error {err:.2g})"
    return None


def build_fused_decode(model: Any, kernels: Any, cache_factory: Any, vocab: int,
                       cache_kw: str = "past_key_values") -> tuple[FusedDecode | None, str | None]:
    """(A checked `FusedDecode` for `model`, None), or (None, why it does not apply)."""
    why = _layout_problem(model) if kernels is not None and hasattr(kernels, "decode_layer") else "no compiled kernels"
    step = None
    if why is None:
        step = FusedDecode(model, kernels)
        why = check(model, step, cache_factory, vocab, cache_kw)
        if why is not None:
            step = None
    return step, why
