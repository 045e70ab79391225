"""A lean decode step for T5-layout encoder-decoders (T5 1.0 / 1.1, Flan-T5, mT5, and gqakit's
grouped versions of them; fp32 or any dtype, any device).

transformers runs a T5 decoder step through its modules: per layer three sub-layers, each
with its norm, dropout and module calls, the attention masks built again every step,
T5's position-bias mask combined with the causal one in every layer, and the static cache's
`index_copy_`. At batch 8 the weights and both caches stream in a few tens of ms, and that
per-op cost is a large part of a step with few KV heads. `T5Step` computes the same step
as tensor operations on the model's own weights and caches: per layer the self-attention
(RMS norm, q/k/v, the new K/V written into the self-attention cache's slot, attention over
the filled slots with T5's relative position bias, computed once per step as T5 does), the
cross-attention (query heads folded per KV head, over the cross-attention cache filled by
the prefix) and the MLP (ReLU or gated GELU), then the final norm and the LM head. Linear
layers are called through their `forward` attribute, so once-packed weights
(`packed.packed_linears`) are used as in the model's own step.

With gqakit's compiled CPU kernels (fp32 on the CPU; `kernels.py`) each decoder block is one
call instead (`t5_decode_layer`: norms, q/k/v stacked in one panel GEMM, the cache write,
self-attention with the position bias, cross-attention, gated MLP, residuals), its weights
packed once into one huge-page buffer in the order the step reads them (`packed.pack_arena`):
the per-op cost of each block's small ops goes, a cost the same at every G (docs/decode.md).
`prepare(cache)`, after the prefix, lays the cross-attention keys out once in the transposed
blocks the kernel's many-rows path reads (`key_blocks`), instead of transposing them per step.

It is for the models whose architecture table entry names the `t5` decode layout
(`core/arch.py`'s `decode`), and it is checked before use: one step from two equally filled caches, lean and the model's
own, must give the same logits and write the same self-attention cache slot
(`check_t5_step`); otherwise the model's own step runs.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any

from gqakit.core.loaded import find_loaded
from gqakit.runtime import grouped  # its functions looked up per call, so SdpaSpy sees them
from gqakit.runtime.packed import pack_arena


def t5_layout_problem(model: Any) -> str | None:
    """None if `T5Step` computes `model`'s decoder step, else why not."""
    import torch

    spec = find_loaded(model)
    if spec is None or spec.decode != "t5":  # the architecture table entry names the decoder step
        return f"the lean encoder-decoder step covers the T5 layout, not {type(model).__name__}"
    dec = getattr(model, "decoder", None)
    blocks = getattr(dec, "block", None)
    if not blocks or len(blocks[0].layer) != 3:
        return "the decoder's blocks are not T5's (self-attention, cross-attention, MLP)"
    if any(blk.layer[0].SelfAttention.has_relative_attention_bias for blk in blocks[1:]):
        return "a position-bias table in every block (UMT5), not T5's one in block 0"
    if model.training:
        return "the model is in training mode"
    if next(model.parameters()).dtype == torch.float16:
        return "float16 (T5 clamps its activations there; the lean step does not)"
    return None


# The MLPs `t5_decode_layer` computes, by (gated, dense_act_fn): its `mlp_kind`.
_MLP_KINDS = {(True, "gelu_new"): 4, (True, "gelu_pytorch_tanh"): 4, (True, "silu"): 0, (True, "swish"): 0,
              (False, "relu"): 3}


def _fused_problem(model: Any, kernels: Any) -> str | None:
    """None if `kernels.t5_decode_layer` computes `model`'s decoder blocks, else why not."""
    import torch

    cfg = model.config
    p = next(model.parameters())
    if kernels is None or not hasattr(kernels, "t5_decode_layer"):
        return "no compiled kernels"
    if p.dtype != torch.float32 or p.device.type != "cpu":
        return "the compiled block is fp32 on the CPU"
    if (bool(getattr(cfg, "is_gated_act", False)), getattr(cfg, "dense_act_fn", None)) not in _MLP_KINDS:
        return f"an MLP the compiled block does not compute ({getattr(cfg, 'feed_forward_proj', '?')})"
    if any(isinstance(getattr(m, "bias", None), torch.Tensor) for m in model.decoder.modules()
           if isinstance(m, torch.nn.Linear)):
        return "biases in the decoder's linear layers"
    return None


class T5Step:
    """`model`'s decoder step as plain tensor operations, or with `kernels` (`kernels.load()`)
    one compiled call per block where it applies (see the module docstring; `fused_note` says
    why not). Called like the model for one decode step: `step(tokens=[B, 1],
    cache=EncoderDecoderCache)`; returns an object with `.logits` [B, 1, vocab]. The
    cross-attention cache must be filled (by the decoder prefix), as after any first decoder call."""

    def __init__(self, model: Any, kernels: Any = None) -> None:
        cfg = model.config
        dec = model.decoder
        self.embed = dec.embed_tokens
        self.final_norm = dec.final_layer_norm
        self.head = model.lm_head
        self.scale_out = cfg.d_model ** -0.5 if getattr(cfg, "scale_decoder_outputs", False) else None
        self.layers = []
        for block in dec.block:
            sa, ca, ff = block.layer
            mlp = ff.DenseReluDense
            gated = hasattr(mlp, "wi_0")
            self.layers.append(SimpleNamespace(
                n0=sa.layer_norm, att=sa.SelfAttention, n1=ca.layer_norm, cross=ca.EncDecAttention,
                n2=ff.layer_norm, gated=gated, wi0=mlp.wi_0 if gated else mlp.wi, wi1=mlp.wi_1 if gated else None,
                wo=mlp.wo, act=mlp.act))
        first = self.layers[0].att  # its table gives the position bias, which T5 shares with every block
        self.heads = first.n_heads
        self.head_dim = first.key_value_proj_dim
        self.kernels, self.packed_bytes = None, 0
        self._key_blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> its cross keys laid out
        self.fused_note = _fused_problem(model, kernels)
        if self.fused_note is None:
            self._pack(kernels, cfg)

    def _pack(self, kernels: Any, cfg: Any) -> None:
        """Every matrix a fused step streams, packed into one buffer in the order it reads them."""
        import torch

        def cat(*lin: Any) -> Any:
            return torch.cat([m.weight.detach() for m in lin]) if len(lin) > 1 else lin[0].weight.detach()

        mats = []
        for e in self.layers:
            mats += [cat(e.att.q, e.att.k, e.att.v), cat(e.att.o), cat(e.cross.q), cat(e.cross.o),
                     cat(e.wi0, e.wi1) if e.gated else cat(e.wi0), cat(e.wo)]
        packed = pack_arena(kernels, mats + [self.head.weight.detach()])
        for i, e in enumerate(self.layers):
            e.wqkv, e.wso, e.wcq, e.wco, e.wgu, e.wd = packed[6 * i: 6 * i + 6]
            e.inter = e.wo.in_features
        self.packed_head, self.vocab = packed[-1], self.head.weight.shape[0]
        self.mlp_kind = _MLP_KINDS[(bool(cfg.is_gated_act), cfg.dense_act_fn)]
        self.eps = float(cfg.layer_norm_epsilon)
        self.kernels, self.packed_bytes = kernels, sum(t.numel() * 4 for t in packed)

    def prepare(self, cache: Any) -> bool:
        """Lay out the cross-attention keys of `cache`, just filled by the decoder prefix, as the
        compiled block reads them (`key_blocks`: blocks of 16 positions, transposed), once per
        prefix instead of transposing them in every step; only where the grouped attention takes
        that path (6 or more query heads per K/V head). Call again if the cross-attention cache is
        refilled in place. A step on a cache not prepared reads the keys as they are. The copy
        lives as long as `cache`. Returns whether the keys were laid out."""
        self._key_blocks.pop(cache, None)
        if self.kernels is None:
            return False
        blocks = [self.kernels.key_blocks(c.keys.contiguous(), self.heads) for c in cache.cross_attention_cache.layers]
        if any(b.numel() for b in blocks):
            self._key_blocks[cache] = blocks
        return cache in self._key_blocks

    def linears(self) -> list[Any]:
        """The linear layers a step calls, in the order it calls them (for `packed_linears`' arena)."""
        out = []
        for e in self.layers:
            out += [e.att.q, e.att.k, e.att.v, e.att.o, e.cross.q, e.cross.o, e.wi0]
            out += [e.wi1, e.wo] if e.gated else [e.wo]
        return out + [self.head]

    @staticmethod
    def _norm(norm: Any, x: Any) -> Any:
        import torch

        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(var + norm.variance_epsilon)
        if norm.weight.dtype in (torch.float16, torch.bfloat16):
            y = y.to(norm.weight.dtype)
        return norm.weight * y

    def _attend(self, q: Any, keys: Any, values: Any, bias: Any) -> Any:
        """q [B, H, D] against [B, G, T, D] K/V (query heads folded per KV head), additive
        bias [1, H, T] or None; [B, H * D] out. T5 does not scale the scores. Without a bias
        (the cross-attention), on the CPU in fp32, gqakit's fused decode kernel, which reads
        the cache faster than SDPA at every G (MHA included); else SDPA."""
        import torch

        b, h, d = q.shape
        g, t = keys.shape[1], keys.shape[2]
        q4 = q.reshape(b, h, 1, d)
        if bias is None and grouped.fused_applies(q4, keys, values, None):
            # the cross-attention: gqakit's fused CPU kernel (scores, softmax, values in one pass per chunk)
            return grouped.decode_attention(q4, keys, values, None, 1.0, fused=True).reshape(b, h * d)
        qf = q.reshape(b, g, h // g, d)
        mask = None if bias is None else bias.reshape(1, g, h // g, t)
        out = torch.nn.functional.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=1.0)
        return out.reshape(b, h * d)

    def __call__(self, tokens: Any, cache: Any) -> Any:
        import torch

        b = tokens.shape[0]
        own = cache.self_attention_cache.layers
        cross = cache.cross_attention_cache.layers
        slot = int(own[0].cumulative_length)
        # T5's relative position bias of this query position over the filled slots 0..slot (block 0's table)
        bias = self.layers[0].att.compute_bias(1, slot + 1, device=tokens.device, past_seen_tokens=slot)[:, :, 0]  # [1, H, slot+1]
        if self.kernels is not None:
            return self._fused(tokens, own, cross, slot, bias[0], self._key_blocks.get(cache))
        h, d = self.heads, self.head_dim
        x = self.embed(tokens).reshape(b, -1)
        for e, sc, cc in zip(self.layers, own, cross):
            a = e.att
            y = self._norm(e.n0, x)
            q = a.q.forward(y).reshape(b, h, d)
            k = a.k.forward(y).reshape(b, -1, 1, d)
            v = a.v.forward(y).reshape(b, -1, 1, d)
            sc.keys[:, :, slot:slot + 1] = k
            sc.values[:, :, slot:slot + 1] = v
            sc.cumulative_length.add_(1)
            o = self._attend(q, sc.keys[:, :, :slot + 1], sc.values[:, :, :slot + 1], bias.to(q.dtype))
            x = x + a.o.forward(o)
            y = self._norm(e.n1, x)
            q = e.cross.q.forward(y).reshape(b, h, d)
            x = x + e.cross.o.forward(self._attend(q, cc.keys, cc.values, None))
            y = self._norm(e.n2, x)
            z = e.act(e.wi0.forward(y))
            if e.gated:
                z = z * e.wi1.forward(y)
            x = x + e.wo.forward(z.to(e.wo.weight.dtype))
        return self._head(x, b)

    def _head(self, x: Any, b: int) -> Any:
        x = self._norm(self.final_norm, x)
        if self.scale_out is not None:
            x = x * self.scale_out
        if self.kernels is not None:
            logits = self.kernels.skinny_linear(x.contiguous(), self.packed_head, self.vocab, None)
        else:
            logits = self.head.forward(x)
        return SimpleNamespace(logits=logits.reshape(b, 1, -1))

    def _fused(self, tokens: Any, own: Any, cross: Any, slot: int, bias: Any, key_blocks: list | None) -> Any:
        """The step as one `t5_decode_layer` call per block: over the whole self-attention cache,
        the slots after this one masked, the position bias zero-padded to the cache's length;
        the cross-attention keys from `key_blocks` where `prepare` laid them out."""
        import torch

        b, t = tokens.shape[0], own[0].keys.shape[2]
        mask = torch.zeros(b, t)
        mask[:, slot + 1:] = float("-inf")
        head_bias = torch.zeros(self.heads, t)
        head_bias[:, :slot + 1] = bias
        x = self.embed(tokens).reshape(b, -1).contiguous()
        blocks = key_blocks or [torch.Tensor()] * len(self.layers)
        for e, sc, cc, kb in zip(self.layers, own, cross, blocks):
            x = self.kernels.t5_decode_layer(x, e.n0.weight, e.n1.weight, e.n2.weight, self.eps, e.wqkv, e.wso,
                                             sc.keys, sc.values, slot, mask, head_bias, e.wcq, e.wco, cc.keys,
                                             cc.values, e.wgu, e.wd, self.heads, e.inter, self.mlp_kind, kb)
            sc.cumulative_length.add_(1)
        return self._head(x, b)


def check_t5_step(model: Any, step: T5Step, new_cache: Any, vocab: int, start: int, *, cache_kw: str = "past_key_values",
                  seed: int = 0) -> str | None:
    """One decode step both ways, from two caches filled by the same encoder output and decoder
    prefix: None if the logits and the written self-attention slot agree (`layers.verdict`, the
    fused decoder-only step's check), else why not."""
    import torch
    from transformers.modeling_outputs import BaseModelOutput

    from gqakit.runtime.layers import verdict

    gen = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    with torch.inference_mode():
        b, n, p = 2, 7, 3
        src = torch.randint(0, vocab, (b, n), generator=gen).to(dev)
        encoded = BaseModelOutput(last_hidden_state=model.get_encoder()(input_ids=src).last_hidden_state)
        prefix = torch.randint(0, vocab, (b, p), generator=gen).to(dev)
        prefix[:, 0] = start
        caches = [new_cache(p + 2, n) for _ in range(2)]
        for c in caches:
            model(encoder_outputs=encoded, decoder_input_ids=prefix, **{cache_kw: c}, use_cache=True)
        step.prepare(caches[1])  # as after any prefix: the path the steps then take
        tok = torch.randint(0, vocab, (b, 1), generator=gen).to(dev)
        ref = model(encoder_outputs=encoded, decoder_input_ids=tok, **{cache_kw: caches[0]}, use_cache=True).logits
        got = step(tok, caches[1]).logits
    return verdict(SimpleNamespace(ref=ref[:, -1], got=got[:, -1], ref_cache=caches[0].self_attention_cache,
                                   got_cache=caches[1].self_attention_cache, p=p), what="the lean T5 step")
