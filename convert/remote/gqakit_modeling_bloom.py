"""BLOOM with grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

Only the attention module changes. `self_attention.query_key_value` (Linear, weight
`[(H+2G)*D, hidden]`, with bias) has its output rows viewed as `(G, H/G + 2, D)`: for each
group g its H/G query heads, then its K head, then its V head. With G = H that is the stock
per-head `(H, 3, D)` layout. The KV cache stores G heads (H/G times less cache memory).

ALiBi: each query head's slope is a function of its head index. A conversion may reorder
query heads (a grouping moves heads that share a K/V head together); `gqakit_query_head_order`
in config.json then says, per layer, which source head each query head is, and each head
gets that source head's slope. Without it (or with the identity order) the model is
numerically the stock model at G = H.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import BloomConfig, BloomForCausalLM
from transformers.models.bloom import modeling_bloom


class GqakitBloomConfig(BloomConfig):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_bloom"

    num_key_value_heads: int | None = None
    # each layer's KV heads (the largest is num_key_value_heads); None: num_key_value_heads in every layer
    num_key_value_heads_per_layer: list[int] | None = None
    gqakit_query_head_order: list | None = None  # per layer: the source head of each query head

    def __post_init__(self, **kwargs: Any) -> None:
        check_kv_heads_per_layer(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_head
        if self.num_key_value_heads < 1 or self.n_head % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide n_head ({self.n_head})")
        order = self.gqakit_query_head_order
        if order is not None and (len(order) != self.n_layer
                                  or any(sorted(o) != list(range(self.n_head)) for o in order)):
            raise ValueError(f"gqakit_query_head_order must hold, for each of the {self.n_layer} layers, "
                             f"an order of the {self.n_head} query heads")
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


def head_order(config: GqakitBloomConfig, layer_idx: int | None) -> list[int] | None:
    """The source head of each query head of layer `layer_idx`, or None where it is the identity."""
    order = config.gqakit_query_head_order
    if order is None or layer_idx is None or list(order[layer_idx]) == list(range(config.n_head)):
        return None
    return [int(i) for i in order[layer_idx]]


class GqakitBloomAttention(modeling_bloom.BloomAttention):
    """BloomAttention with G key/value heads in the grouped fused layout described above."""

    def __init__(self, config: GqakitBloomConfig, layer_idx: int | None = None) -> None:
        super().__init__(config, layer_idx)
        self.num_key_value_heads = kv_heads_at(config, layer_idx)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        out = (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim
        self.query_key_value = torch.nn.Linear(self.hidden_size, out, bias=True)
        self.head_order = head_order(config, layer_idx)

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        alibi: torch.Tensor,
        attention_mask: torch.Tensor,
        layer_past: Any = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, q_length, _ = hidden_states.shape
        G, n_rep, D = self.num_key_value_heads, self.num_key_value_groups, self.head_dim
        # (batch, seq, G, n_rep + 2, D) -> (batch, G, n_rep + 2, seq, D)
        qkv = self.query_key_value(hidden_states).view(batch_size, q_length, G, n_rep + 2, D).permute(0, 2, 3, 1, 4)
        # Query head g*n_rep + r is group g's r-th query: the order repeat_interleave assumes.
        query_layer = qkv[:, :, :n_rep].flatten(1, 2)
        key_layer, value_layer = qkv[:, :, n_rep], qkv[:, :, n_rep + 1]

        if layer_past is not None:
            key_layer, value_layer = layer_past.update(key_layer, value_layer, self.layer_idx)  # G heads
        if n_rep > 1:
            key_layer = key_layer.repeat_interleave(n_rep, dim=1)
            value_layer = value_layer.repeat_interleave(n_rep, dim=1)
        if self.head_order is not None:  # each query head keeps its source head's slope
            alibi = alibi.view(batch_size, self.num_heads, *alibi.shape[1:])[:, self.head_order].flatten(0, 1)

        # from here on, stock BloomAttention on H heads
        query_layer = query_layer.reshape(batch_size * self.num_heads, -1, D)
        key_layer = key_layer.reshape(batch_size * self.num_heads, -1, D).transpose(-1, -2)
        value_layer = value_layer.reshape(batch_size * self.num_heads, -1, D)
        attention_scores = alibi.baddbmm(batch1=query_layer, batch2=key_layer, beta=self.beta,
                                         alpha=self.inv_norm_factor)
        attn_weights = attention_scores.view(batch_size, self.num_heads, q_length, -1)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_layer.dtype)
        attention_probs = self.attention_dropout(attention_probs)
        attention_probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, -1)
        context_layer = self._merge_heads(torch.bmm(attention_probs_reshaped, value_layer))
        if self.pretraining_tp > 1 and self.slow_but_exact:
            slices = self.hidden_size / self.pretraining_tp
            output_tensor = torch.zeros_like(context_layer)
            for i in range(self.pretraining_tp):
                output_tensor = output_tensor + F.linear(
                    context_layer[:, :, int(i * slices): int((i + 1) * slices)],
                    self.dense.weight[:, int(i * slices): int((i + 1) * slices)],
                )
        else:
            output_tensor = self.dense(context_layer)
        output_tensor = modeling_bloom.dropout_add(output_tensor, residual, self.hidden_dropout, self.training)
        return output_tensor, attention_probs


class GqakitBloomForCausalLM(BloomForCausalLM):
    config_class = GqakitBloomConfig
    config: GqakitBloomConfig

    def __init__(self, config: GqakitBloomConfig) -> None:
        super().__init__(config)
        for i, block in enumerate(self.transformer.h):
            block.self_attention = GqakitBloomAttention(config, layer_idx=i)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitBloomConfig.register_for_auto_class()
GqakitBloomForCausalLM.register_for_auto_class("AutoModelForCausalLM")
