"""MPT with grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

Only the attention module changes. `attn.Wqkv` (Linear, weight `[(H+2G)*D, hidden]`) produces
rows `[q heads (H*D) | k heads (G*D) | v heads (G*D)]`, head-major; with G = H this is exactly
stock MPT. `clip_qkv` clamps the fused output as in the stock model. The KV cache stores G
heads (H/G times less cache memory).

ALiBi: each query head's slope is a function of its head index. A conversion may reorder
query heads (a grouping moves heads that share a K/V head together); `gqakit_query_head_order`
in config.json then says, per layer, which source head each query head is, and each head
gets that source head's slope. Without it (or with the identity order) the model is
numerically the stock model at G = H.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import MptConfig, MptForCausalLM
from transformers.models.mpt import modeling_mpt


class GqakitMptConfig(MptConfig):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_mpt"

    num_key_value_heads: int | None = None
    # each layer's KV heads (the largest is num_key_value_heads); None: num_key_value_heads in every layer
    num_key_value_heads_per_layer: list[int] | None = None
    gqakit_query_head_order: list | None = None  # per layer: the source head of each query head

    def __post_init__(self, **kwargs: Any) -> None:
        check_kv_heads_per_layer(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_heads
        if self.num_key_value_heads < 1 or self.n_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide n_heads ({self.n_heads})")
        order = self.gqakit_query_head_order
        if order is not None and (len(order) != self.n_layers
                                  or any(sorted(o) != list(range(self.n_heads)) for o in order)):
            raise ValueError(f"gqakit_query_head_order must hold, for each of the {self.n_layers} layers, "
                             f"an order of the {self.n_heads} query heads")
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


def head_order(config: GqakitMptConfig, layer_idx: int | None) -> list[int] | None:
    """The source head of each query head of layer `layer_idx`, or None where it is the identity."""
    order = config.gqakit_query_head_order
    if order is None or layer_idx is None or list(order[layer_idx]) == list(range(config.n_heads)):
        return None
    return [int(i) for i in order[layer_idx]]


class GqakitMptAttention(modeling_mpt.MptAttention):
    """MptAttention with G key/value heads in the `[q | k | v]` layout described above."""

    def __init__(self, config: GqakitMptConfig, layer_idx: int | None = None) -> None:
        super().__init__(config, layer_idx)
        self.num_key_value_heads = kv_heads_at(config, layer_idx)
        self.num_key_value_groups = self.n_heads // self.num_key_value_heads
        out = (self.n_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.Wqkv = nn.Linear(self.hidden_size, out, bias=False)
        self.head_order = head_order(config, layer_idx)

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        position_bias: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, seq_length = hidden_states.shape[:2]
        H, G, D = self.n_heads, self.num_key_value_heads, self.head_dim
        mixed_qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        query_states, key_states, value_states = mixed_qkv.split([H * D, G * D, G * D], dim=2)
        query_states = query_states.reshape(batch_size, seq_length, H, D).transpose(1, 2)
        key_states = key_states.reshape(batch_size, seq_length, G, D).transpose(1, 2)
        value_states = value_states.reshape(batch_size, seq_length, G, D).transpose(1, 2)

        if cache is not None:  # G heads
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        if self.num_key_value_groups > 1:
            key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
            value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)

        # from here on, stock MptAttention on H heads
        attention_scores = torch.matmul(query_states, key_states.transpose(-1, -2)) * self.softmax_scale
        query_length = seq_length if cache is None else seq_length + cache.get_seq_length()
        if position_bias is not None:
            if len(position_bias.shape) != 3:
                raise ValueError(f"Expecting position_bias shape to be 3 dimensions, got {len(position_bias.shape)}")
            if self.head_order is not None:  # each query head keeps its source head's slope
                position_bias = position_bias[self.head_order]
            key_length = key_states.shape[-2]
            position_bias_query_index = max(0, position_bias.size(1) - query_length)
            position_bias_key_index = max(0, position_bias.size(2) - key_length)
            position_bias = position_bias[:, position_bias_query_index:, position_bias_key_index:]
            attention_scores = attention_scores + position_bias
        if attention_mask is not None:
            attention_scores = attention_scores.masked_fill(attention_mask, torch.finfo(query_states.dtype).min)
        attn_weights = nn.functional.softmax(attention_scores.float(), dim=-1).to(value_states.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attn_dropout_p, training=self.training)
        context_states = torch.matmul(attn_weights, value_states)
        context_states = context_states.permute(0, 2, 1, 3).contiguous().view(batch_size, seq_length, -1)
        return self.out_proj(context_states), attn_weights


class GqakitMptForCausalLM(MptForCausalLM):
    config_class = GqakitMptConfig
    config: GqakitMptConfig

    def __init__(self, config: GqakitMptConfig) -> None:
        super().__init__(config)
        for i, block in enumerate(self.transformer.blocks):
            block.attn = GqakitMptAttention(config, layer_idx=i)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitMptConfig.register_for_auto_class()
GqakitMptForCausalLM.register_for_auto_class("AutoModelForCausalLM")
