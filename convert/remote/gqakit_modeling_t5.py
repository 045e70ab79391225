"""T5 and mT5 with grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

Only the attention modules change. `k` / `v` have KV*d_kv output features, head-major
(no bias, as stock); `q` / `o` and the relative position bias (one per query head) are stock.
The decoder's self- and cross-attention have `num_key_value_heads` KV heads, the encoder
`encoder_num_key_value_heads` (each None = num_heads). Both caches of the decoder
(`EncoderDecoderCache`) hold KV heads; K/V reach the query heads only inside the attention
computation. With KV = num_heads the model is numerically the stock model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.mt5 import modeling_mt5
from transformers.models.t5 import modeling_t5

KV_KEYS = ("num_key_value_heads", "encoder_num_key_value_heads")


def resolve_kv_heads(config: Any, heads: dict[str, int]) -> None:
    """Set each KV key of CONFIG that is None to its stack's heads (HEADS: key -> query heads);
    refuse a count that does not divide them."""
    for key, n_heads in heads.items():
        kv = getattr(config, key)
        if kv is None:
            kv = n_heads
            setattr(config, key, kv)
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or n_heads % kv:
            raise ValueError(f"{key} ({kv!r}) must be a positive divisor of the number of attention heads "
                             f"({n_heads})")


class GqakitT5Config(T5Config):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_t5"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        resolve_kv_heads(self, dict.fromkeys(KV_KEYS, self.num_heads))
        super().__post_init__(**kwargs)


class GqakitMT5Config(MT5Config):
    model_type = "gqakit_mt5"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        resolve_kv_heads(self, dict.fromkeys(KV_KEYS, self.num_heads))
        super().__post_init__(**kwargs)


class GqaT5AttentionMixin:
    """T5Attention / MT5Attention with `num_key_value_heads` KV heads; `stock_eager` is the
    family's eager attention function, which gets K/V repeated to the query heads."""

    stock_eager: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def __init__(self, config: Any, has_relative_attention_bias: bool = False, layer_idx: int | None = None,
                 is_causal: bool = False, num_key_value_heads: int | None = None) -> None:
        super().__init__(config, has_relative_attention_bias=has_relative_attention_bias,  # type: ignore[call-arg]
                         layer_idx=layer_idx, is_causal=is_causal)
        self.num_key_value_heads = num_key_value_heads or self.n_heads
        # Read by transformers' sdpa/flex attention functions to take the GQA path.
        self.num_key_value_groups = self.n_heads // self.num_key_value_heads
        kv_dim = self.num_key_value_heads * self.key_value_proj_dim
        self.k = torch.nn.Linear(self.d_model, kv_dim, bias=False)
        self.v = torch.nn.Linear(self.d_model, kv_dim, bias=False)

    def eager_gqa(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n_rep = self.num_key_value_groups
        if n_rep > 1:  # with one KV head per query head, the stock tensors as they are
            key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
        return type(self).stock_eager(module, query, key, value, *args, **kwargs)

    def forward(  # the stock forward, with the GQA eager function as the default
        self,
        hidden_states: torch.Tensor,
        mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
        cache: Any = None,
        past_key_values: Any = None,  # the name before transformers 5.24
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        past_seen_tokens = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        # Cloned for StaticCache: read before the update, used after it.
        past_seen_tokens = past_seen_tokens.clone() if isinstance(past_seen_tokens, torch.Tensor) else past_seen_tokens
        is_cross_attention = key_value_states is not None
        query_states = self.q(hidden_states).view(*input_shape, -1, self.key_value_proj_dim).transpose(1, 2)

        is_updated, curr_cache = False, cache
        if isinstance(cache, EncoderDecoderCache):
            is_updated = cache.is_updated.get(self.layer_idx)
            curr_cache = cache.cross_attention_cache if is_cross_attention else cache.self_attention_cache

        current_states = key_value_states if is_cross_attention else hidden_states
        if is_cross_attention and cache is not None and is_updated:
            # the encoder's K/V, projected at the first step
            key_states = curr_cache.layers[self.layer_idx].keys
            value_states = curr_cache.layers[self.layer_idx].values
        else:
            kv_shape = (*current_states.shape[:-1], -1, self.key_value_proj_dim)
            key_states = self.k(current_states).view(kv_shape).transpose(1, 2)  # KV heads
            value_states = self.v(current_states).view(kv_shape).transpose(1, 2)
            if cache is not None:
                key_states, value_states = curr_cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
                if is_cross_attention and isinstance(cache, EncoderDecoderCache):
                    cache.is_updated[self.layer_idx] = True

        if position_bias is None:  # one bias per query head
            key_length = key_states.shape[-2]
            if not self.has_relative_attention_bias:
                position_bias = torch.zeros((1, self.n_heads, input_shape[1], key_length),
                                            device=query_states.device, dtype=query_states.dtype)
                if self.gradient_checkpointing and self.training:
                    position_bias.requires_grad = True
            else:
                position_bias = self.compute_bias(input_shape[1], key_length, device=query_states.device,
                                                  past_seen_tokens=past_seen_tokens)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self.eager_gqa
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, mask,
            dropout=0.0 if not self.training else self.dropout, scaling=self.scaling,  # T5: 1.0
            position_bias=position_bias, **kwargs,
        )
        attn_output = self.o(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, position_bias, attn_weights


class GqakitT5Attention(GqaT5AttentionMixin, modeling_t5.T5Attention):
    stock_eager = staticmethod(modeling_t5.eager_attention_forward)


class GqakitMT5Attention(GqaT5AttentionMixin, modeling_mt5.MT5Attention):
    stock_eager = staticmethod(modeling_mt5.eager_attention_forward)


def group_attention(model: Any, attention_class: type) -> None:
    """Replace every attention module of MODEL (encoder self, decoder self and cross) by
    ATTENTION_CLASS with the stack's KV heads; each keeps its stock flags and config."""
    for stack, kv in ((model.encoder, model.config.encoder_num_key_value_heads),
                      (model.decoder, model.config.num_key_value_heads)):
        for block in stack.block:
            for layer in block.layer[:-1]:  # self-attention, then (decoder) cross-attention
                name = "SelfAttention" if hasattr(layer, "SelfAttention") else "EncDecAttention"
                old = getattr(layer, name)
                setattr(layer, name, attention_class(
                    old.config, has_relative_attention_bias=old.has_relative_attention_bias,
                    layer_idx=old.layer_idx, is_causal=old.is_causal, num_key_value_heads=kv))


class GqakitT5ForConditionalGeneration(T5ForConditionalGeneration):
    config_class = GqakitT5Config
    config: GqakitT5Config

    def __init__(self, config: GqakitT5Config) -> None:
        super().__init__(config)
        group_attention(self, GqakitT5Attention)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


class GqakitMT5ForConditionalGeneration(MT5ForConditionalGeneration):
    config_class = GqakitMT5Config
    config: GqakitMT5Config

    def __init__(self, config: GqakitMT5Config) -> None:
        super().__init__(config)
        group_attention(self, GqakitMT5Attention)
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitT5Config.register_for_auto_class()
GqakitT5ForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")
GqakitMT5Config.register_for_auto_class()
GqakitMT5ForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")
