"""Falcon with grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

Only the attention module changes. `self_attention.query_key_value` (weight
`[(H+2G)*D, hidden]`) has its output rows viewed as `(G, H/G + 2, D)`: for each group g its
H/G query heads (g*H/G ... (g+1)*H/G-1), then its K head, then its V head. That is the stock
layout of both Falcon decoders at G = H: the original one's per-head `(H, 3, D)` rows
(Falcon-RW) and the new decoder architecture's grouped rows (whose stock class also reads
`num_kv_heads`, but caches K and V broadcast to H heads). The KV cache here stores G heads.
Everything else (layer norms, parallel attention, rotary or ALiBi) is the stock model's.

ALiBi (`alibi: true`): each query head's slope is a function of its head index. A conversion
may reorder query heads (a grouping moves heads that share a K/V head together);
`gqakit_query_head_order` in config.json then says, per layer, which source head each query
head is, and each head gets that source head's slope, both in the bias the eager path adds
and in the one stock Falcon puts inside the attention mask. With rotary the order changes
nothing and is not read. Without it (or with the identity order) the model is numerically
the stock model at G = H.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import FalconConfig, FalconForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.falcon import modeling_falcon


class GqakitFalconConfig(FalconConfig):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_falcon"

    num_key_value_heads: int | None = None
    # each layer's KV heads (the largest is num_key_value_heads); None: num_key_value_heads in every layer
    num_key_value_heads_per_layer: list[int] | None = None
    gqakit_query_head_order: list | None = None  # per layer: the source head of each query head

    def __post_init__(self, **kwargs: Any) -> None:
        check_kv_heads_per_layer(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_kv_heads or self.num_attention_heads
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                             f"num_attention_heads ({self.num_attention_heads})")
        self.num_kv_heads = self.num_key_value_heads
        order, H = self.gqakit_query_head_order, self.num_attention_heads
        if order is not None and (len(order) != self.num_hidden_layers
                                  or any(sorted(o) != list(range(H)) for o in order)):
            raise ValueError(f"gqakit_query_head_order must hold, for each of the {self.num_hidden_layers} "
                             f"layers, an order of the {H} query heads")
        super().__post_init__(**kwargs)


def check_kv_heads_per_layer(config: Any) -> None:
    """`num_key_value_heads_per_layer`, when given: one entry per layer, each dividing the query
    heads; `num_key_value_heads` is the largest of them (set to it when not given)."""
    per_layer = config.num_key_value_heads_per_layer
    if per_layer is None:
        return
    if config.num_key_value_heads is None and per_layer:
        config.num_key_value_heads = max(per_layer)
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    if (len(per_layer) != layers or any(not isinstance(g, int) or g < 1 or heads % g for g in per_layer)
            or config.num_key_value_heads != max(per_layer)):
        raise ValueError(f"num_key_value_heads_per_layer ({per_layer}) must give each of the {layers} layers KV "
                         f"heads that divide the {heads} query heads, the largest being num_key_value_heads "
                         f"({config.num_key_value_heads})")


def kv_heads_at(config: Any, layer_idx: int | None) -> int:
    """The KV heads of layer `layer_idx`: its entry of `num_key_value_heads_per_layer`, else
    `num_key_value_heads` (every layer the same)."""
    per_layer = getattr(config, "num_key_value_heads_per_layer", None)
    if per_layer is None:
        return config.num_key_value_heads
    if layer_idx is None:
        raise ValueError("a model whose layers have their own KV heads builds each attention with its layer_idx")
    return int(per_layer[layer_idx])


def head_order(config: GqakitFalconConfig, layer_idx: int | None) -> list[int] | None:
    """The source head of each query head of layer `layer_idx` where ALiBi is on and the order is
    not the identity; None otherwise."""
    order = config.gqakit_query_head_order
    if not config.alibi or order is None or layer_idx is None:
        return None
    if list(order[layer_idx]) == list(range(config.num_attention_heads)):
        return None
    return [int(i) for i in order[layer_idx]]


class GqakitFalconAttention(modeling_falcon.FalconAttention):
    """FalconAttention with G key/value heads in the grouped fused layout described above."""

    def __init__(self, config: GqakitFalconConfig, layer_idx: int | None = None) -> None:
        super().__init__(config, layer_idx)
        self.num_kv_heads = kv_heads_at(config, layer_idx)
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.query_key_value = modeling_falcon.FalconLinear(self.hidden_size, out, bias=config.bias)
        self.head_order = head_order(config, layer_idx)

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        alibi: torch.Tensor | None,
        attention_mask: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        layer_past: Any = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden_states.shape
        n_rep, D = self.num_key_value_groups, self.head_dim
        # (batch, seq, G, n_rep + 2, D) -> (batch, G, n_rep + 2, seq, D)
        qkv = self.query_key_value(hidden_states).view(batch, length, self.num_kv_heads, n_rep + 2, D)
        qkv = qkv.permute(0, 2, 3, 1, 4)
        # Query head g*n_rep + r is group g's r-th query: the order repeat_interleave gives K/V.
        query = qkv[:, :, :n_rep].flatten(1, 2)
        key, value = qkv[:, :, n_rep], qkv[:, :, n_rep + 1]
        if alibi is None:
            cos, sin = position_embeddings
            query, key = modeling_falcon.apply_rotary_pos_emb(query, key, cos, sin)
        elif self.head_order is not None:  # each query head keeps its source head's slope
            alibi = alibi.reshape(batch, self.num_heads, -1)[:, self.head_order].reshape(alibi.shape)
            if attention_mask is not None and attention_mask.shape[1] == self.num_heads:  # the bias inside the mask
                attention_mask = attention_mask[:, self.head_order]
        if layer_past is not None:
            key, value = layer_past.update(key, value, self.layer_idx)  # G heads
        impl = self.config._attn_implementation
        if impl != "eager" and not output_attentions:
            # SDPA and the other registered kernels take G K/V heads (`num_key_value_groups`);
            # with ALiBi, the bias is already inside the mask, as in stock Falcon
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)
            out, weights = attention(self, query, key, value, attention_mask, scaling=self.inv_norm_factor,
                                     dropout=self.attention_dropout.p if self.training and alibi is not None else 0.0,
                                     **kwargs)
            return self.dense(out.reshape(batch, length, self.num_heads * D)), weights
        key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
        if alibi is None:  # stock Falcon's eager attention, on K/V repeated to H heads
            scores = query @ key.transpose(-1, -2) / D ** 0.5
            weights = F.softmax(scores + attention_mask, dim=-1, dtype=hidden_states.dtype)
        else:
            scores = query @ key.transpose(-1, -2)
            if scores.dtype in (torch.float16, torch.bfloat16):
                scores = scores.to(torch.float32)
            logits = (scores + alibi.view(batch, self.num_heads, 1, -1)) * self.inv_norm_factor
            weights = self.attention_dropout(F.softmax(logits + attention_mask, dim=-1, dtype=hidden_states.dtype))
        out = weights @ value
        out = out.transpose(1, 2).reshape(batch, length, self.num_heads * D)
        return self.dense(out), weights


class GqakitFalconForCausalLM(FalconForCausalLM):
    config_class = GqakitFalconConfig
    config: GqakitFalconConfig

    def __init__(self, config: GqakitFalconConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.transformer.h):
            layer.self_attention = GqakitFalconAttention(config, layer_idx=i)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitFalconConfig.register_for_auto_class()
GqakitFalconForCausalLM.register_for_auto_class("AutoModelForCausalLM")
