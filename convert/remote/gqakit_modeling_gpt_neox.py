"""GPT-NeoX (Pythia) with grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

Only the attention module changes. `attention.query_key_value` (Linear, weight
`[(H+2G)*D, hidden]`) has its output rows viewed as `(G, H/G + 2, D)`: for each group g its
H/G query heads (g*H/G ... (g+1)*H/G-1), then its K head, then its V head. With G = H that is
the stock per-head `(H, 3, D)` layout, so the model is numerically the stock model. The KV
cache stores G heads (H/G times less cache memory). Rotary (incl. partial rotary) is stock.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt_neox import modeling_gpt_neox


class GqakitGPTNeoXConfig(GPTNeoXConfig):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_gpt_neox"

    num_key_value_heads: int | None = None
    # each layer's KV heads (the largest is num_key_value_heads); None: num_key_value_heads in every layer
    num_key_value_heads_per_layer: list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        check_kv_heads_per_layer(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                             f"num_attention_heads ({self.num_attention_heads})")
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


def eager_gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock GPT-NeoX eager attention on K/V repeated to H heads (the cache keeps G heads)."""
    n_rep = module.num_key_value_groups
    return modeling_gpt_neox.eager_attention_forward(
        module, query, key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1), *args, **kwargs
    )


class GqakitGPTNeoXAttention(modeling_gpt_neox.GPTNeoXAttention):
    """GPTNeoXAttention with G key/value heads in the grouped fused layout described above."""

    def __init__(self, config: GqakitGPTNeoXConfig, layer_idx: int | None = None) -> None:
        super().__init__(config, layer_idx)
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = kv_heads_at(config, layer_idx)
        # Read by transformers' sdpa/flash/flex attention functions to take the GQA path.
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        out = (self.num_heads + 2 * self.num_key_value_heads) * self.head_size
        self.query_key_value = torch.nn.Linear(config.hidden_size, out, bias=config.attention_bias)

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        layer_past: Any = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        n_rep = self.num_key_value_groups
        # (batch, seq, G, n_rep + 2, D) -> (batch, G, n_rep + 2, seq, D)
        qkv = self.query_key_value(hidden_states).view(*input_shape, self.num_key_value_heads, n_rep + 2, -1)
        qkv = qkv.permute(0, 2, 3, 1, 4)
        # Query head g*n_rep + r is group g's r-th query: the order repeat_kv / enable_gqa assume.
        query_states = qkv[:, :, :n_rep].flatten(1, 2)
        key_states, value_states = qkv[:, :, n_rep], qkv[:, :, n_rep + 1]

        cos, sin = position_embeddings
        query_states, key_states = modeling_gpt_neox.apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if layer_past is not None:
            key_states, value_states = layer_past.update(key_states, value_states, self.layer_idx)  # G heads

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_gqa_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling, dropout=0.0 if not self.training else self.attention_dropout, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.dense(attn_output), attn_weights


class GqakitGPTNeoXForCausalLM(GPTNeoXForCausalLM):
    config_class = GqakitGPTNeoXConfig
    config: GqakitGPTNeoXConfig

    def __init__(self, config: GqakitGPTNeoXConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.gpt_neox.layers):
            layer.attention = GqakitGPTNeoXAttention(config, layer_idx=i)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


# Pythia models (and stock save_pretrained) name the LM head `embed_out`; stock transformers
# renames it by class name, which does not cover custom code, so register the same renaming
# here (loading accepts `embed_out.` and `lm_head.`; saving writes `embed_out.` like stock).
try:
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    register_checkpoint_conversion_mapping(
        GqakitGPTNeoXForCausalLM.__name__,
        [WeightRenaming(source_patterns=r"^embed_out\.", target_patterns="lm_head.")],
        overwrite=True,  # the module is imported again for each model folder
    )
except ImportError:  # older transformers 5.x: model files must then use `lm_head.`
    pass

# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitGPTNeoXConfig.register_for_auto_class()
GqakitGPTNeoXForCausalLM.register_for_auto_class("AutoModelForCausalLM")
