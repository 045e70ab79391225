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
from gqakit.core.errors import GqakitError
from test_convert import equalize_kv, load, logits, num_heads
from tiny_models import FAMILIES, LAYERS, _configs


def test_every_family_has_a_pico_model():
    assert FAMILIES == sorted(arch.registry()) and len(FAMILIES) >= 13
    assert set(_configs()) == set(arch.registry()), "add a pico model for each new family to tests/tiny_models.py"


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
    loaded = arch.loaded_shape(model.config)
    assert (loaded.num_layers, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim, loaded.max_positions) == \
        (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.max_positions)
    blocks = arch.decoder_blocks(model)
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


def test_table_rejects_an_entry_whose_attention_is_outside_its_block():
    entry = arch.registry()["llama"].model_dump()
    for block in ("model.decoder.{layer}", "model.layers"):
        entry["block"] = block
        with pytest.raises(ValueError, match="must lie inside block"):
            arch.ArchSpec.model_validate(entry)


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
