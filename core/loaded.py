"""What gqakit reads off a model transformers has loaded: its geometry from its config
(`loaded_shape`, `loaded_seq2seq_shape`: any family, since transformers maps each family's
key names onto common ones), its entry in the architecture table (`find_loaded`) and its
decoder blocks (`decoder_blocks`), through DDP, torch.compile and peft wrappers."""

from __future__ import annotations

from typing import Any

from gqakit.core.arch import (ArchSpec, Seq2SeqShape, Shape, find, layer_kv_heads_of, lookup, max_positions,
                              positions_of)
from gqakit.core.errors import GqakitError
from gqakit.core.windows import layer_windows_of


def loaded_shape(hf_config: Any) -> Shape:
    """The geometry of a loaded model's config (any family: transformers maps every family's
    own key names onto num_attention_heads, num_hidden_layers, ...). No rotary facts. A family
    whose layers have their own KV heads (the table's `config.heads_in_group` or `kv_heads_list`) gets
    them per layer; layers that attend over a sliding window get their windows."""
    cfg = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    spec = find(cfg.to_dict())
    per_layer = None
    if spec is not None:
        per_layer = layer_kv_heads_of(spec.config, cfg.to_dict(), heads)
    if per_layer is not None:
        kv_heads = max(per_layer)
        per_layer = None if len(set(per_layer)) == 1 else per_layer
    hidden = getattr(cfg, "hidden_size", None)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    return Shape(int(cfg.num_hidden_layers), heads, kv_heads, head_dim, int(hidden or heads * head_dim), 0,
                 max_positions(cfg.to_dict()), per_layer,
                 layer_windows_of(spec.sliding if spec else None, cfg.to_dict(), int(cfg.num_hidden_layers)))


# config.json keys of an encoder-decoder's geometry: (T5 / mT5 names, BART names)
_SEQ2SEQ_KEYS = {
    "encoder_layers": ("num_layers", "encoder_layers"),
    "decoder_layers": ("num_decoder_layers", "decoder_layers"),
    "encoder_heads": ("num_heads", "encoder_attention_heads"),
    "decoder_heads": ("num_heads", "decoder_attention_heads"),
}


def loaded_seq2seq_shape(hf_config: Any) -> Seq2SeqShape:
    """The geometry of a loaded encoder-decoder's config (T5, mT5, BART and gqakit's GQA
    versions of them: `num_key_value_heads` for the decoder's self- and cross-attention,
    `encoder_num_key_value_heads` for the encoder)."""
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)

    def first(name: str) -> int:
        for key in _SEQ2SEQ_KEYS[name]:
            if isinstance(cfg.get(key), int):
                return int(cfg[key])
        raise GqakitError(f"encoder-decoder config lacks {' or '.join(_SEQ2SEQ_KEYS[name])}")

    hidden = int(cfg.get("d_model") or cfg.get("hidden_size"))
    enc_heads, dec_heads = first("encoder_heads"), first("decoder_heads")
    enc_layers = first("encoder_layers")
    dec_layers = int(cfg.get("num_decoder_layers") or cfg.get("decoder_layers") or enc_layers)
    spec = find(cfg)  # the decoder's context length: its family's keys (Whisper: max_target_positions)
    keys = ("max_position_embeddings", "n_positions", *(spec.config.max_positions if spec else ()))
    positions = positions_of(cfg, keys)

    def shape(layers: int, heads: int, kv: Any) -> Shape:
        head_dim = int(cfg.get("d_kv") or hidden // heads)
        return Shape(layers, heads, int(kv or heads), head_dim, hidden, 0, positions)

    return Seq2SeqShape(shape(enc_layers, enc_heads, cfg.get("encoder_num_key_value_heads")),
                        shape(dec_layers, dec_heads, cfg.get("num_key_value_heads")))


def _unwrapped(model: Any) -> Any:
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):  # DDP / torch.compile wrappers
        model = getattr(model, "module", None) or model._orig_mod
    if hasattr(model, "get_base_model"):  # a peft (LoRA) wrapper
        model = model.get_base_model()
    return model


def _loaded_config(model: Any) -> dict[str, Any]:
    return model.config.to_dict() | {"architectures": [type(model).__name__]}


def find_loaded(model: Any) -> ArchSpec | None:
    """The family of a loaded model (by its class, then its config's model_type), or None."""
    return find(_loaded_config(_unwrapped(model)))


def decoder_blocks(model: Any) -> Any:
    """The model's ModuleList of decoder blocks, where its family's `block` says it is."""
    model = _unwrapped(model)
    spec = lookup(_loaded_config(model))
    return model.get_submodule(spec.blocks)
