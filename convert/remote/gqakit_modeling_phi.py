"""Phi whose decoder layers have their own numbers of KV heads, written by gqakit next to
weights converted with a per-layer KV plan (a uniform conversion is the stock Phi folder:
its class reads one `num_key_value_heads` for every layer).

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

config.json holds `num_key_value_heads_per_layer`, layer i's KV heads G_i (the largest is
`num_key_value_heads`). Layer i's attention is the stock `PhiAttention` built from a copy of
the config whose `num_key_value_heads` is G_i, so its K/V projections and its KV cache
hold G_i heads; everything else is the stock model.
"""

from __future__ import annotations

from typing import Any

from transformers import PhiConfig, PhiForCausalLM
from transformers.models.phi import modeling_phi


class GqakitPhiConfig(PhiConfig):
    # Own model_type: stock transformers without trust_remote_code must refuse this folder.
    model_type = "gqakit_phi"

    # each layer's KV heads (the largest is num_key_value_heads); None: num_key_value_heads in every layer
    num_key_value_heads_per_layer: list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        check_kv_heads_per_layer(self)
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


def kv_heads_at(config: Any, layer_idx: int) -> int:
    """The KV heads of layer `layer_idx`: its entry of `num_key_value_heads_per_layer`, else
    `num_key_value_heads` (every layer the same)."""
    per_layer = getattr(config, "num_key_value_heads_per_layer", None)
    return config.num_key_value_heads if per_layer is None else int(per_layer[layer_idx])


def layer_config(config: Any, layer_idx: int) -> Any:
    """A shallow copy of `config` whose `num_key_value_heads` is layer `layer_idx`'s."""
    cfg = object.__new__(type(config))  # the attributes, without re-validation
    cfg.__dict__.update(config.__dict__)
    cfg.num_key_value_heads = kv_heads_at(config, layer_idx)
    return cfg


class GqakitPhiForCausalLM(PhiForCausalLM):
    config_class = GqakitPhiConfig
    config: GqakitPhiConfig

    def __init__(self, config: GqakitPhiConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            if kv_heads_at(config, i) != config.num_key_value_heads:
                layer.self_attn = modeling_phi.PhiAttention(layer_config(config, i), layer_idx=i)
                layer.self_attn.config = config  # the model's own, read at run time (attention implementation)
        # Initialises only the new modules (the others are already flagged as initialised).
        self.post_init()


# save_pretrained copies this file and writes auto_map, also for models built directly from
# these classes (not only those loaded through the Auto classes).
GqakitPhiConfig.register_for_auto_class()
GqakitPhiForCausalLM.register_for_auto_class("AutoModelForCausalLM")
