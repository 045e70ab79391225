"""BART and the BART-like encoder-decoders (Marian, mBART, M2M100 / NLLB, Pegasus) with
grouped-query attention, written by gqakit next to converted weights.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

The five families share BART's attention module; they differ in positions, layer norms,
embedding scale and LM head, which stay stock. Only the attention modules change. `k_proj` /
`v_proj` have KV*head_dim output features (+bias), head-major; `q_proj` / `out_proj` are
stock, and the queries are scaled by head_dim**-0.5 as stock does. The decoder's self- and
cross-attention have `num_key_value_heads` KV heads, the encoder `encoder_num_key_value_heads`
(each None = the stack's attention heads). Both caches of the decoder (`EncoderDecoderCache`)
hold KV heads; K/V reach the query heads only inside the attention computation. With KV =
heads the model is numerically the stock model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import (BartConfig, BartForConditionalGeneration, M2M100Config, M2M100ForConditionalGeneration,
                          MarianConfig, MarianMTModel, MBartConfig, MBartForConditionalGeneration, PegasusConfig,
                          PegasusForConditionalGeneration)
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bart import modeling_bart
from transformers.models.m2m_100 import modeling_m2m_100
from transformers.models.marian import modeling_marian
from transformers.models.mbart import modeling_mbart
from transformers.models.pegasus import modeling_pegasus


def resolve_kv_heads(config: Any) -> None:
    """Set each KV key of CONFIG that is None to its stack's attention heads; refuse a count
    that does not divide them."""
    for key, heads in (("num_key_value_heads", config.decoder_attention_heads),
                       ("encoder_num_key_value_heads", config.encoder_attention_heads)):
        kv = getattr(config, key)
        if kv is None:
            kv = heads
            setattr(config, key, kv)
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
            raise ValueError(f"{key} ({kv!r}) must be a positive divisor of the number of attention heads "
                             f"({heads})")


class GqakitBartConfig(BartConfig):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_bart"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        resolve_kv_heads(self)
        super().__post_init__(**kwargs)


class GqakitPegasusConfig(PegasusConfig):
    model_type = "gqakit_pegasus"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        resolve_kv_heads(self)
        super().__post_init__(**kwargs)


class GqakitMBartConfig(MBartConfig):
    model_type = "gqakit_mbart"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        resolve_kv_heads(self)
        super().__post_init__(**kwargs)


class GqakitM2M100Config(M2M100Config):
    model_type = "gqakit_m2m100"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        resolve_kv_heads(self)
        super().__post_init__(**kwargs)


class GqakitMarianConfig(MarianConfig):
    model_type = "gqakit_marian"

    num_key_value_heads: int | None = None
    encoder_num_key_value_heads: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        resolve_kv_heads(self)
        super().__post_init__(**kwargs)


class GqaBartAttentionMixin:
    """A BART-layout attention (BartAttention and its copies) with `num_key_value_heads` KV
    heads; `stock_eager` is the family's eager attention function, which gets K/V repeated to
    the query heads."""

    stock_eager: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    num_heads: int
    head_dim: int
    embed_dim: int

    def __init__(self, *args: Any, num_key_value_heads: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_key_value_heads = num_key_value_heads or self.num_heads
        # Read by transformers' sdpa/flash/flex attention functions to take the GQA path.
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        kv_dim = self.num_key_value_heads * self.head_dim
        bias = self.q_proj.bias is not None
        self.k_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=bias)
        self.v_proj = torch.nn.Linear(self.embed_dim, kv_dim, bias=bias)

    def eager_gqa(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's eager attention on K/V repeated to the query heads (the cache keeps KV heads)."""
        n_rep = self.num_key_value_groups
        if n_rep > 1:  # with one KV head per query head, the stock tensors as they are
            key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
        return type(self).stock_eager(module, query, key, value, *args, **kwargs)

    def forward(  # the stock forward, with the GQA eager function as the default
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,  # the name before transformers 5.24
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else past_key_values
        is_cross_attention = key_value_states is not None
        input_shape = hidden_states.shape[:-1]
        query_states = self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)

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
            kv_shape = (*current_states.shape[:-1], -1, self.head_dim)
            key_states = self.k_proj(current_states).view(kv_shape).transpose(1, 2)  # KV heads
            value_states = self.v_proj(current_states).view(kv_shape).transpose(1, 2)
            if cache is not None:
                key_states, value_states = curr_cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
                if is_cross_attention and isinstance(cache, EncoderDecoderCache):
                    cache.is_updated[self.layer_idx] = True

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, self.eager_gqa
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.dropout, scaling=self.scaling, **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.out_proj(attn_output), attn_weights


class GqakitBartAttention(GqaBartAttentionMixin, modeling_bart.BartAttention):
    stock_eager = staticmethod(modeling_bart.eager_attention_forward)


class GqakitPegasusAttention(GqaBartAttentionMixin, modeling_pegasus.PegasusAttention):
    stock_eager = staticmethod(modeling_pegasus.eager_attention_forward)


class GqakitMBartAttention(GqaBartAttentionMixin, modeling_mbart.MBartAttention):
    stock_eager = staticmethod(modeling_mbart.eager_attention_forward)


class GqakitM2M100Attention(GqaBartAttentionMixin, modeling_m2m_100.M2M100Attention):
    stock_eager = staticmethod(modeling_m2m_100.eager_attention_forward)


class GqakitMarianAttention(GqaBartAttentionMixin, modeling_marian.MarianAttention):
    stock_eager = staticmethod(modeling_marian.eager_attention_forward)


def group_attention(model: Any, attention_class: type) -> None:
    """Replace every attention module of MODEL (encoder self, decoder self and cross) by
    ATTENTION_CLASS with the stack's KV heads; each keeps its stock settings and config."""
    def grouped(old: Any, kv: int) -> Any:
        return attention_class(old.embed_dim, old.num_heads, dropout=old.dropout, is_decoder=old.is_decoder,
                               bias=old.q_proj.bias is not None, is_causal=old.is_causal, config=old.config,
                               layer_idx=old.layer_idx, num_key_value_heads=kv)

    for layer in model.model.encoder.layers:
        layer.self_attn = grouped(layer.self_attn, model.config.encoder_num_key_value_heads)
    for layer in model.model.decoder.layers:
        layer.self_attn = grouped(layer.self_attn, model.config.num_key_value_heads)
        layer.encoder_attn = grouped(layer.encoder_attn, model.config.num_key_value_heads)


class GqakitBartForConditionalGeneration(BartForConditionalGeneration):
    config_class = GqakitBartConfig
    config: GqakitBartConfig

    def __init__(self, config: GqakitBartConfig) -> None:
        super().__init__(config)
        group_attention(self, GqakitBartAttention)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


class GqakitPegasusForConditionalGeneration(PegasusForConditionalGeneration):
    config_class = GqakitPegasusConfig
    config: GqakitPegasusConfig

    def __init__(self, config: GqakitPegasusConfig) -> None:
        super().__init__(config)
        group_attention(self, GqakitPegasusAttention)
        self.post_init()


class GqakitMBartForConditionalGeneration(MBartForConditionalGeneration):
    config_class = GqakitMBartConfig
    config: GqakitMBartConfig

    def __init__(self, config: GqakitMBartConfig) -> None:
        super().__init__(config)
        group_attention(self, GqakitMBartAttention)
        self.post_init()


class GqakitM2M100ForConditionalGeneration(M2M100ForConditionalGeneration):
    config_class = GqakitM2M100Config
    config: GqakitM2M100Config

    def __init__(self, config: GqakitM2M100Config) -> None:
        super().__init__(config)
        group_attention(self, GqakitM2M100Attention)
        self.post_init()


class GqakitMarianMTModel(MarianMTModel):
    config_class = GqakitMarianConfig
    config: GqakitMarianConfig

    def __init__(self, config: GqakitMarianConfig) -> None:
        super().__init__(config)
        group_attention(self, GqakitMarianAttention)
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
for _config, _model in ((GqakitBartConfig, GqakitBartForConditionalGeneration),
                        (GqakitPegasusConfig, GqakitPegasusForConditionalGeneration),
                        (GqakitMBartConfig, GqakitMBartForConditionalGeneration),
                        (GqakitM2M100Config, GqakitM2M100ForConditionalGeneration),
                        (GqakitMarianConfig, GqakitMarianMTModel)):
    _config.register_for_auto_class()
    _model.register_for_auto_class("AutoModelForSeq2SeqLM")
del _config, _model
