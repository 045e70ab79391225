"""The architecture table against the models it describes, family by family.

Every family in `core/architectures/` gets a pico model (tests/tiny_models.py); its entry
must name that model's decoder blocks, attention tensors, context length and geometry, and
(for families without stock GQA) the classes of its modeling file. The conversion tests
(test_convert.py and the align-refit test below) run over the same list.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from gqakit.convert import convert_checkpoint
from gqakit.convert.layout import layer_names
from gqakit.convert.remote import modeling_file
from gqakit.core import arch
from gqakit.core import loaded as loaded_mod
from gqakit.core.errors import GqakitError
from test_convert import equalize_kv, load, logits, num_heads
from tiny_models import (BART_LIKE, FAMILIES, LAYERS, SEQ2SEQ_FAMILIES, SEQ2SEQ_FAMILY, SEQ2SEQ_KINDS, _configs,
                         _seq2seq_configs, seq2seq_auto)


def test_every_family_has_a_pico_model():
    assert sorted(FAMILIES + SEQ2SEQ_FAMILIES) == sorted(arch.registry()) and len(FAMILIES) >= 13
    assert not set(FAMILIES) & set(SEQ2SEQ_FAMILIES) and len(SEQ2SEQ_FAMILIES) >= 3
    assert set(_configs()) == set(FAMILIES), "add a pico model for each new family to tests/tiny_models.py"
    assert set(SEQ2SEQ_FAMILY) == set(SEQ2SEQ_KINDS) == set(_seq2seq_configs())
    assert set(SEQ2SEQ_FAMILY.values()) == set(SEQ2SEQ_FAMILIES), \
        "add a pico encoder-decoder for each new family to tests/tiny_models.py (build_seq2seq)"


@pytest.mark.parametrize("family", FAMILIES)
def test_entry_matches_the_model_on_meta(family):
    """Built on the meta device (no memory): every named tensor and module exists."""
    cfg = _configs()[family]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    config = cfg.to_dict() | {"architectures": [type(model).__name__]}
    spec = arch.lookup(config)
    assert spec.family == family
    shape = arch.shape_of(spec, config)
    assert shape.num_layers == LAYERS and shape.max_positions == 128
    loaded = loaded_mod.loaded_shape(model.config)
    assert (loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim, loaded.max_positions) == \
        (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.max_positions)
    blocks = loaded_mod.decoder_blocks(model)
    assert isinstance(blocks, torch.nn.ModuleList) and len(blocks) == LAYERS
    assert [model.get_submodule(spec.block_name(L)) for L in range(LAYERS)] == list(blocks)
    sd = model.state_dict()
    for L in range(LAYERS):
        names = layer_names(spec, L)
        weights = [n for role, n in names.items() if role.endswith("weight")]
        assert weights and all(n in sd for n in weights), [n for n in weights if n not in sd]
        assert all(n.startswith(spec.block_name(L) + ".") for n in names.values())
    per_token = 2 * LAYERS * shape.num_kv_heads * shape.head_dim * 2
    assert shape.kv_bytes_per_token(2) == per_token == 2 * shape.kv_bytes_per_token(2, shape.num_kv_heads // 2)
    if spec.remote is not None:
        text = modeling_file(family).read_text()
        for cls in (spec.remote.config_class, spec.remote.model_class):
            assert re.search(rf"^class {cls}\b", text, re.M), f"{modeling_file(family).name} lacks {cls}"


@pytest.mark.parametrize("kind", SEQ2SEQ_KINDS)
def test_encoder_decoder_entry_matches_the_model_on_meta(kind):
    """Every tensor and block an encoder-decoder's entry names exists in the model built on
    the meta device: decoder self- and cross-attention, encoder self-attention, and the
    tensors only block 0 holds; its geometry is `loaded_seq2seq_shape`'s."""
    cfg = _seq2seq_configs()[kind]()
    with torch.device("meta"):
        model = seq2seq_auto(kind).from_config(cfg)
    config = cfg.to_dict() | {"architectures": [type(model).__name__]}
    spec = arch.lookup(config)
    assert spec.family == SEQ2SEQ_FAMILY[kind] and spec.is_encoder_decoder
    dec, enc = arch.shape_of(spec, config), arch.encoder_shape_of(spec, config)
    loaded = loaded_mod.loaded_seq2seq_shape(model.config)
    assert (dec.num_layers, dec.num_heads, dec.num_kv_heads, dec.head_dim, dec.hidden_size) == \
        (loaded.decoder.num_layers, loaded.decoder.num_heads, loaded.decoder.num_kv_heads,
         loaded.decoder.head_dim, loaded.decoder.hidden_size) == (LAYERS, 4, 4, cfg.to_dict().get("d_kv") or 8, 32)
    assert (enc.num_layers, enc.num_heads, enc.num_kv_heads, enc.head_dim) == \
        (loaded.encoder.num_layers, loaded.encoder.num_heads, loaded.encoder.num_kv_heads, loaded.encoder.head_dim)
    blocks = loaded_mod.decoder_blocks(model)
    assert [model.get_submodule(spec.block_name(L)) for L in range(LAYERS)] == list(blocks)
    sd = model.state_dict()
    for stack, sites in ((spec.block, ("self", "cross")), (spec.encoder.block, ("encoder",))):
        for L in range(LAYERS):
            assert isinstance(model.get_submodule(stack.format(layer=L)), torch.nn.Module)
            for site in sites:
                names = layer_names(spec, L, site)
                weights = [n for role, n in names.items() if role.endswith("weight")]
                assert len(weights) == 4 and all(n in sd for n in weights), [n for n in weights if n not in sd]
                assert all(n.startswith(stack.format(layer=L) + ".") for n in names.values())
                biases = {role for role, n in names.items() if role.endswith("bias") and n in sd}
                # BART-like: every projection has a bias; Whisper: all but k_proj; T5: none
                assert biases == ({"q.bias", "k.bias", "v.bias"} if kind in BART_LIKE
                                  else {"q.bias", "v.bias"} if kind == "whisper" else set())
            for n in spec.first_block_only:
                assert (f"{stack.format(layer=L)}.{n}" in sd) == (L == 0)
    assert spec.first_block_only == ([] if kind in (*BART_LIKE, "whisper")
                                     else ["layer.0.SelfAttention.relative_attention_bias.weight"])
    text = modeling_file(spec.family).read_text()
    for cls in (spec.remote.config_class, spec.remote.model_class):
        assert re.search(rf"^class {cls}\b", text, re.M), f"{modeling_file(spec.family).name} lacks {cls}"


def test_table_rejects_an_entry_whose_attention_is_outside_its_block():
    entry = arch.registry()["llama"].model_dump()
    for block in ("model.decoder.{layer}", "model.layers"):
        entry["block"] = block
        with pytest.raises(ValueError, match="must lie inside block"):
            arch.ArchSpec.model_validate(entry)
    t5 = arch.registry()["t5"].model_dump()
    t5["cross_attention"]["prefix"] = "encoder.block.{layer}.layer.1.EncDecAttention."
    with pytest.raises(ValueError, match="cross_attention.prefix .* must lie inside block"):
        arch.ArchSpec.model_validate(t5)
    t5 = arch.registry()["t5"].model_dump()
    t5["encoder"]["attention"]["prefix"] = "decoder.block.{layer}.layer.0.SelfAttention."
    with pytest.raises(ValueError, match="encoder.attention.prefix .* must lie inside block"):
        arch.ArchSpec.model_validate(t5)


def test_max_positions_of_a_family_not_in_the_table():
    assert arch.max_positions({"model_type": "mamba", "seq_length": 4096}) == 4096
    assert arch.max_positions({"model_type": "gpt2", "n_positions": 1024, "max_position_embeddings": 7}) == 1024
    assert arch.max_positions({"model_type": "llama"}) is None


def test_stablelm_with_per_head_qk_layernorm_is_rejected(tiny_model, tmp_path):
    src = tiny_model("stablelm", qk_layernorm=True)
    with pytest.raises(GqakitError, match="qk_layernorm=True is not supported"):
        convert_checkpoint(src, tmp_path / "out", 4, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["align", "align-refit"])
@pytest.mark.parametrize("family", FAMILIES)
def test_align_converts_equal_heads_exactly(tiny_model, tmp_path, family, method, one_thread):
    """K/V heads identical within each pair: align (the default) and align-refit (the
    calibrated stage) keep the logits, in every family."""
    src = tiny_model(family)
    model = load(src)
    equalize_kv(model, family, 2)
    model.save_pretrained(tmp_path / "expanded")
    out = convert_checkpoint(tmp_path / "expanded", tmp_path / "out", num_heads(model) // 2, method,
                             calibration_tokens=256, options={"seq_len": 32} if method == "align-refit" else None,
                             progress=False)
    torch.testing.assert_close(logits(load(out)), logits(model), rtol=0, atol=2e-4)


def test_cli_default_method_is_the_registry_default():
    from gqakit.convert.cli import convert_cmd
    from gqakit.convert.methods import METHODS
    from gqakit.convert.settings import DEFAULT_METHOD
    default = next(p.default for p in convert_cmd.params if p.name == "method")
    assert default == DEFAULT_METHOD and not METHODS[default].needs_data
