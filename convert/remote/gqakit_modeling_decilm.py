"""A Llama-shaped decoder whose layers have different numbers of KV heads, in the
nemotron-nas (DeciLM) config layout; written by gqakit next to weights converted with a
per-layer plan.

Self-contained on purpose: this file is copied into model folders and imported by stock
transformers (`trust_remote_code=True`), so it may import only torch and transformers.

config.json holds, per decoder layer, `block_configs[i] = {"attention": {"n_heads_in_group":
H / G_i, "no_op": false, "replace_with_linear": false}, "ffn": {"intermediate_size": I,
"no_op": false, "replace_with_linear": false}}` (with `ffn_mult` too when it gives I exactly),
the layout that vLLM's `DeciLMForCausalLM` reads; its entries read as attributes
(`config.block_configs[i].attention.n_heads_in_group`) and as dicts. Layer i is a stock
`LlamaDecoderLayer` built with G_i KV heads, so its KV cache holds G_i heads; `qkv_bias` gives
q, k and v biases without an o bias (a Qwen2-shaped source), as vLLM reads it. Blocks whose
attention or FFN is a no-op or a linear replacement are refused: gqakit never writes them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama


class BlockEntry(dict):
    """A dict whose keys also read as attributes (nested entries too); JSON-serialisable as a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__({k: BlockEntry(v) if isinstance(v, dict) else v for k, v in data.items()})

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """The FFN width that a DeciLM `ffn_mult` stands for: 2/3 of ffn_mult × hidden, rounded up to 256."""
    n = int(2 * ffn_mult * hidden_size / 3)
    return n if n % 256 == 0 else n + 256 - n % 256


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"
    _auto_class = "AutoConfig"  # save_pretrained writes this file beside the config (auto_map)

    block_configs: list | None = None
    qkv_bias: bool | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        if self.block_configs is None:  # a config built from defaults: every layer as num_key_value_heads says
            group = self.num_attention_heads // (self.num_key_value_heads or self.num_attention_heads)
            attention = {"n_heads_in_group": group, "no_op": False, "replace_with_linear": False}
            self.block_configs = [{"attention": attention,
                                   "ffn": {"intermediate_size": self.intermediate_size, "no_op": False,
                                           "replace_with_linear": False}}] * self.num_hidden_layers
        if len(self.block_configs) != self.num_hidden_layers:
            raise ValueError(f"block_configs needs one entry per layer ({self.num_hidden_layers})")
        self.block_configs = [b if isinstance(b, BlockEntry) else BlockEntry(dict(b)) for b in self.block_configs]
        for i, b in enumerate(self.block_configs):
            for part in ("attention", "ffn"):
                if b[part].get("no_op") or b[part].get("replace_with_linear"):
                    raise ValueError(f"block_configs[{i}].{part}: no-op and linear blocks are not supported")
            group = b.attention.n_heads_in_group
            if not isinstance(group, int) or group < 1 or self.num_attention_heads % group:
                raise ValueError(f"block_configs[{i}].attention.n_heads_in_group ({group}) must divide "
                                 f"num_attention_heads ({self.num_attention_heads})")
        self.num_key_value_heads = max(self.kv_heads_of(i) for i in range(self.num_hidden_layers))

    def kv_heads_of(self, layer: int) -> int:
        return self.num_attention_heads // self.block_configs[layer].attention.n_heads_in_group

    def intermediate_size_of(self, layer: int) -> int:
        ffn = self.block_configs[layer].ffn
        if "ffn_mult" in ffn:
            return ffn_mult_to_intermediate_size(ffn.ffn_mult, self.hidden_size)
        return int(ffn.intermediate_size)

    def layer_config(self, layer: int) -> LlamaConfig:
        """A plain copy of this config with layer `layer`'s KV heads and FFN width."""
        cfg = object.__new__(type(self))  # a shallow copy: the attributes, without re-validation
        cfg.__dict__.update(self.__dict__)
        cfg.num_key_value_heads = self.kv_heads_of(layer)
        cfg.intermediate_size = self.intermediate_size_of(layer)
        return cfg


class DeciLMForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose decoder layer i has the KV heads and FFN width of `block_configs[i]`."""

    config_class = DeciLMConfig
    _auto_class = "AutoModelForCausalLM"

    def __init__(self, config: DeciLMConfig) -> None:
        super().__init__(config)
        qkv_bias = config.attention_bias if config.qkv_bias is None else config.qkv_bias
        for i in range(config.num_hidden_layers):
            cfg = config.layer_config(i)
            cfg.attention_bias = qkv_bias
            layer = modeling_llama.LlamaDecoderLayer(cfg, layer_idx=i)
            if bool(config.attention_bias) != bool(qkv_bias):
                o = layer.self_attn.o_proj
                layer.self_attn.o_proj = torch.nn.Linear(o.in_features, o.out_features, bias=config.attention_bias)
            layer.self_attn.config = config
            self.model.layers[i] = layer
        self.post_init()
