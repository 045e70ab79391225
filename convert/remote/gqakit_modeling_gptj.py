"""GPT-J with grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

Only the attention module changes: `k_proj` / `v_proj` have G*D output features (no bias),
head-major; `q_proj` / `out_proj` are stock. Rotary (rotate-every-two on the first
`rotary_dim` dims of each head) is stock. With G = H the model is numerically the stock
model. The KV cache stores G heads (H/G times less cache memory).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import GPTJConfig, GPTJForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gptj import modeling_gptj


class GqakitGPTJConfig(GPTJConfig):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_gptj"

    num_key_value_heads: int | None = None
    # each layer's KV heads (the largest is num_key_value_heads); None: num_key_value_heads in every layer
    num_key_value_heads_per_layer: list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        check_kv_heads_per_layer(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_head
        if self.num_key_value_heads < 1 or self.n_head % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                             f"n_head ({self.n_head})")
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
    """Stock GPT-J eager attention on K/V repeated to H heads (the cache keeps G heads)."""
    n_rep = module.num_key_value_groups
    return modeling_gptj.eager_attention_forward(
        module, query, key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1), *args, **kwargs
    )


class GqakitGPTJAttention(modeling_gptj.GPTJAttention):
    """GPTJAttention with G key/value heads."""

    def __init__(self, config: GqakitGPTJConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.num_key_value_heads = kv_heads_at(config, layer_idx)
        # Read by transformers' sdpa/flash/flex attention functions to take the GQA path.
        self.num_key_value_groups = self.num_attention_heads // self.num_key_value_heads
        kv_dim = self.num_key_value_heads * self.head_dim
        self.k_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=False)
        self.v_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=False)

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        past = kwargs.pop("past_key_values", None)  # the cache's name before transformers 5.24
        cache = cache if cache is not None else past
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)              # H heads
        key = self.k_proj(hidden_states).view(hidden_shape)                # G heads
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        sin, cos = position_embeddings
        rot = self.rotary_dim if self.rotary_dim is not None else self.head_dim
        query = torch.cat([modeling_gptj.apply_rotary_pos_emb(query[..., :rot], sin, cos), query[..., rot:]], dim=-1)
        key = torch.cat([modeling_gptj.apply_rotary_pos_emb(key[..., :rot], sin, cos), key[..., rot:]], dim=-1)
        query, key = query.transpose(1, 2), key.transpose(1, 2)

        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)  # G heads

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_gqa_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.resid_dropout(self.out_proj(attn_output)), attn_weights


class GqakitGPTJForCausalLM(GPTJForCausalLM):
    config_class = GqakitGPTJConfig
    config: GqakitGPTJConfig

    def __init__(self, config: GqakitGPTJConfig) -> None:
        super().__init__(config)
        for i, block in enumerate(self.transformer.h):
            block.attn = GqakitGPTJAttention(config, layer_idx=i)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitGPTJConfig.register_for_auto_class()
GqakitGPTJForCausalLM.register_for_auto_class("AutoModelForCausalLM")
