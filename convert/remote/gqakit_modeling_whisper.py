"""Whisper with grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

Only the attention modules change. `k_proj` (no bias) and `v_proj` (+bias) have KV*head_dim
output features, head-major; `q_proj` / `out_proj` are stock, and the queries are scaled by
head_dim**-0.5 before the product, as stock does. The decoder's self- and cross-attention have
`num_key_value_heads` KV heads, the audio encoder `encoder_num_key_value_heads` (each None =
the stack's attention heads). Both caches of the decoder (`EncoderDecoderCache`) hold KV
heads; K/V reach the query heads only inside the attention computation. With KV = heads the
model is numerically the stock model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.whisper import modeling_whisper


class GqakitWhisperConfig(WhisperConfig):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_whisper"
    # Stock WhisperConfig aliases num_key_value_heads to encoder_attention_heads: here it is the
    # decoder's own KV heads (read by the GQA attention and by transformers' static caches).
    attribute_map = {k: v for k, v in WhisperConfig.attribute_map.items() if k != "num_key_value_heads"}

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        for key, heads in (("num_key_value_heads", self.decoder_attention_heads),
                           ("encoder_num_key_value_heads", self.encoder_attention_heads)):
            kv = getattr(self, key)
            if kv is None:
                kv = heads
                setattr(self, key, kv)
            if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
                raise ValueError(f"{key} ({kv!r}) must be a positive divisor of the number of attention heads "
                                 f"({heads})")
        super().__post_init__(**kwargs)


def eager_gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock Whisper eager attention on K/V repeated to the query heads (the cache keeps KV heads)."""
    n_rep = module.num_key_value_groups
    if n_rep > 1:  # with one KV head per query head, the stock tensors as they are
        key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    return modeling_whisper.eager_attention_forward(module, query, key, value, *args, **kwargs)


class GqakitWhisperAttention(modeling_whisper.WhisperAttention):
    """WhisperAttention with `num_key_value_heads` KV heads."""

    def __init__(self, *args: Any, num_key_value_heads: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_key_value_heads = num_key_value_heads or self.num_heads
        # Read by transformers' sdpa/flash/flex attention functions to take the GQA path.
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        kv_dim = self.num_key_value_heads * self.head_dim
        self.k_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=False)
        self.v_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=self.v_proj.bias is not None)

    def forward(  # type: ignore[override]  # the stock forward, with the GQA eager function as the default
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        past_key_values: Any = None,  # the name before transformers 5.24
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else past_key_values
        is_cross_attention = key_value_states is not None
        input_shape = hidden_states.shape[:-1]
        # scaled before the product, as stock Whisper does (the attention call then scales by 1.0)
        query_states = (self.q_proj(hidden_states) * self.scaling).view(*input_shape, -1, self.head_dim)
        query_states = query_states.transpose(1, 2).contiguous()

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
            kv_shape = (input_shape[0], -1, self.num_key_value_heads, self.head_dim)
            key_states = self.k_proj(current_states).view(kv_shape).transpose(1, 2).contiguous()  # KV heads
            value_states = self.v_proj(current_states).view(kv_shape).transpose(1, 2).contiguous()
            if cache is not None:
                key_states, value_states = curr_cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
                if is_cross_attention and isinstance(cache, EncoderDecoderCache):
                    cache.is_updated[self.layer_idx] = True

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_gqa_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.dropout, scaling=1.0,
            output_attentions=output_attentions, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.out_proj(attn_output), attn_weights


def grouped(old: modeling_whisper.WhisperAttention, kv: int) -> GqakitWhisperAttention:
    """A GQA attention module with OLD's settings and KV key/value heads."""
    return GqakitWhisperAttention(old.embed_dim, old.num_heads, dropout=old.dropout, is_decoder=old.is_decoder,
                                  bias=old.q_proj.bias is not None, is_causal=old.is_causal, config=old.config,
                                  layer_idx=old.layer_idx, num_key_value_heads=kv)


class GqakitWhisperForConditionalGeneration(WhisperForConditionalGeneration):
    config_class = GqakitWhisperConfig
    config: GqakitWhisperConfig

    def __init__(self, config: GqakitWhisperConfig) -> None:
        super().__init__(config)
        for layer in self.model.encoder.layers:
            layer.self_attn = grouped(layer.self_attn, config.encoder_num_key_value_heads)
        for layer in self.model.decoder.layers:
            layer.self_attn = grouped(layer.self_attn, config.num_key_value_heads)
            layer.encoder_attn = grouped(layer.encoder_attn, config.num_key_value_heads)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitWhisperConfig.register_for_auto_class()
GqakitWhisperForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")
