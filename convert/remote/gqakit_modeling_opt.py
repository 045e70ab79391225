"""OPT with grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

Only the attention module changes: `k_proj` / `v_proj` have G*D output features (+bias), head-
major; `q_proj` / `out_proj` are stock. With G = H the model is numerically the stock model.
The KV cache stores G heads (H/G times less cache memory).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import OPTConfig, OPTForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.opt import modeling_opt


class GqakitOPTConfig(OPTConfig):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_opt"

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
    """Stock OPT eager attention on K/V repeated to H heads (the cache keeps G heads)."""
    n_rep = module.num_key_value_groups
    return modeling_opt.eager_attention_forward(
        module, query, key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1), *args, **kwargs
    )


class GqakitOPTAttention(modeling_opt.OPTAttention):
    """OPTAttention with G key/value heads."""

    def __init__(self, config: GqakitOPTConfig, layer_idx: int | None = None) -> None:
        super().__init__(config, layer_idx)
        self.num_key_value_heads = kv_heads_at(config, layer_idx)
        # Read by transformers' sdpa/flash/flex attention functions to take the GQA path.
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        kv_dim = self.num_key_value_heads * self.head_dim
        self.k_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=self.enable_bias)
        self.v_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=self.enable_bias)

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        past_key_values: Any = None,
        cache: Any = None,  # transformers >= 5.24 passes the cache under this name
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        bsz, tgt_len, _ = hidden_states.size()
        # OPT scales q before the product (and passes scaling=1.0 below), as stock does, so
        # G = H reproduces stock rounding exactly.
        query_states = (self.q_proj(hidden_states) * self.scaling).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, tgt_len, -1, self.head_dim).transpose(1, 2)

        past_key_values = cache if cache is not None else past_key_values
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)  # G heads

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_gqa_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.dropout, scaling=1.0, **kwargs,
        )
        attn_output = attn_output.reshape(bsz, tgt_len, -1).contiguous()
        return self.out_proj(attn_output), attn_weights


class GqakitOPTForCausalLM(OPTForCausalLM):
    config_class = GqakitOPTConfig
    config: GqakitOPTConfig

    def __init__(self, config: GqakitOPTConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.model.decoder.layers):
            layer.self_attn = GqakitOPTAttention(config, layer_idx=i)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitOPTConfig.register_for_auto_class()
GqakitOPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
