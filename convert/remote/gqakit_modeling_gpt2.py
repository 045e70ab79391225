"""GPT-2 with grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

Only the self-attention module changes. `attn.c_attn` (Conv1D, weight `[hidden, (H+2G)*D]`)
produces columns `[q heads (H*D) | k heads (G*D) | v heads (G*D)]`, head-major; with G = H this
is exactly stock GPT-2, so the model is numerically the stock model. The KV cache stores G
heads, which is the point of the conversion (H/G times less cache memory).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gpt2 import modeling_gpt2
from transformers.pytorch_utils import Conv1D


class GqakitGPT2Config(GPT2Config):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder
    # (it would otherwise build a 3*hidden c_attn and fail on shapes, or worse).
    model_type = "gqakit_gpt2"

    num_key_value_heads: int | None = None
    # each layer's KV heads (the largest is num_key_value_heads); None: num_key_value_heads in every layer
    num_key_value_heads_per_layer: list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        check_kv_heads_per_layer(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_head
        if self.num_key_value_heads < 1 or self.n_head % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide n_head ({self.n_head})")
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
    """Stock GPT-2 eager attention on K/V repeated to H heads (the cache keeps G heads)."""
    n_rep = module.num_key_value_groups
    return modeling_gpt2.eager_attention_forward(
        module, query, key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1), *args, **kwargs
    )


class GqakitGPT2Attention(modeling_gpt2.GPT2Attention):
    """GPT2Attention (self-attention only) with G key/value heads.

    Subclassing keeps scaling (scale_attn_weights, scale_attn_by_inverse_layer_idx),
    reorder_and_upcast_attn, dropouts, weight init and output_attentions recording as stock.
    """

    def __init__(self, config: GqakitGPT2Config, layer_idx: int | None = None) -> None:
        super().__init__(config, is_cross_attention=False, layer_idx=layer_idx)
        self.num_key_value_heads = kv_heads_at(config, layer_idx)
        # Read by transformers' sdpa/flash/flex attention functions to take the GQA path.
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.kv_dim = self.num_key_value_heads * self.head_dim
        self.c_attn = Conv1D(self.embed_dim + 2 * self.kv_dim, self.embed_dim)

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        past_key_values: Any = None,
        cache: Any = None,  # transformers >= 5.24 passes the cache under this name
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if encoder_hidden_states is not None:
            raise ValueError("GqakitGPT2Attention is self-attention only")
        q, k, v = self.c_attn(hidden_states).split([self.embed_dim, self.kv_dim, self.kv_dim], dim=2)
        # (batch, seq, heads*D) -> (batch, heads, seq, D)
        q, k, v = (t.view(*t.shape[:-1], -1, self.head_dim).transpose(1, 2) for t in (q, k, v))

        past_key_values = cache if cache is not None else past_key_values
        if past_key_values is not None:
            if hasattr(past_key_values, "self_attention_cache"):  # EncoderDecoderCache
                past_key_values = past_key_values.self_attention_cache
            k, v = past_key_values.update(k, v, self.layer_idx)  # stores G heads

        impl = self.config._attn_implementation
        if impl == "eager" and self.reorder_and_upcast_attn:
            n_rep = self.num_key_value_groups
            attn_output, attn_weights = self._upcast_and_reordered_attn(
                q, k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1), attention_mask
            )
        else:
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_gqa_attention_forward)
            attn_output, attn_weights = attention_interface(
                self, q, k, v, attention_mask,
                dropout=self.attn_dropout.p if self.training else 0.0, scaling=self.scaling, **kwargs,
            )

        attn_output = attn_output.reshape(*attn_output.shape[:-2], -1).contiguous()
        attn_output = self.resid_dropout(self.c_proj(attn_output))
        return attn_output, attn_weights


class GqakitGPT2LMHeadModel(GPT2LMHeadModel):
    config_class = GqakitGPT2Config
    config: GqakitGPT2Config

    def __init__(self, config: GqakitGPT2Config) -> None:
        super().__init__(config)
        # Swap in the GQA attention after the stock build; cross-attention (if any) stays stock.
        for i, block in enumerate(self.transformer.h):
            block.attn = GqakitGPT2Attention(config, layer_idx=i)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitGPT2Config.register_for_auto_class()
GqakitGPT2LMHeadModel.register_for_auto_class("AutoModelForCausalLM")
