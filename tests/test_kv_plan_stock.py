"""Per-layer KV heads for the families on a stock transformers GQA class that is not
Llama-shaped (the table's `remote.per_layer_only`): a per-layer output is the family's
`gqakit_<family>` folder with gqakit's modeling file, which only trust_remote_code loads; a
uniform output, also of a per-layer source, is the stock folder, as `-g` writes it. The
per-layer tests they share with the remote families (the pooled reference, the cache heads
after generate, GGUF refusal, the config class's checks) are in tests/test_kv_plan_remote.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError
from test_kv_plan import cache_heads, convert, digest, load, logits, plan_file
from test_kv_plan_remote import LAYERS, PATH, generated_cache_heads, reference, source
from tolerance import assert_close_by_rounding

pytestmark = pytest.mark.usefixtures("one_thread")

STOCK = sorted(f for f, s in archmod.registry().items() if s.remote is not None and s.remote.per_layer_only)


def test_the_stock_class_families_keep_native_gqa():
    assert {"phi", "phi3", "gemma", "gemma2", "olmo", "olmo2", "qwen3", "stablelm"} <= set(STOCK)
    for family in STOCK:
        spec = archmod.registry()[family]
        assert spec.native_gqa and spec.per_layer_kv == family and spec.config.kv_heads_list


def test_per_layer_only_needs_the_familys_own_list():
    spec = archmod.registry()["phi"].model_dump()
    with pytest.raises(ValueError, match="per_layer_only"):
        archmod.ArchSpec.model_validate({**spec, "per_layer_kv": "decilm"})
    with pytest.raises(ValueError, match="per_layer_only"):
        archmod.ArchSpec.model_validate({**spec, "config": {**spec["config"], "kv_heads_list": None}})


@pytest.mark.parametrize("family", STOCK)
def test_uniform_plan_is_the_stock_g_conversion(tiny_model, tmp_path, family):
    """A uniform plan writes -g's bytes: the stock config and class, no modeling file."""
    from transformers import AutoModelForCausalLM

    src, spec, H = source(tiny_model, family)
    a = convert(src, tmp_path / "plan", kv_plan=plan_file(tmp_path, [2] * LAYERS))
    b = convert(src, tmp_path / "g", num_kv_heads=2)
    assert digest(a, "model.safetensors", "config.json") == digest(b, "model.safetensors", "config.json")
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["model_type"] == spec.model_types[0] and cfg["architectures"] == [spec.architectures[0]]
    assert "auto_map" not in cfg and spec.config.kv_heads_list not in cfg and cfg["num_key_value_heads"] == 2
    assert not list(a.glob("gqakit_modeling_*.py"))
    assert "trust_remote_code" not in json.loads((a / "gqakit_convert.json").read_text())["loads_with"]
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)  # stock transformers, no code
    assert type(model).__name__ == spec.architectures[0] and cache_heads(model) == [2] * LAYERS


@pytest.mark.parametrize("family", STOCK)
def test_per_layer_output_loads_only_with_trust_remote_code(tiny_model, tmp_path, family):
    from transformers import AutoModelForCausalLM

    src, spec, H = source(tiny_model, family)
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, [H, 1, H, 2]))
    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(out)
    from gqakit.core.loading import load_causal_lm  # gqakit runs its own, byte-identical file

    assert cache_heads(load_causal_lm(out, dtype=torch.float32, progress=False)) == [H, 1, H, 2]


def test_uniform_conversion_of_a_per_layer_output_is_the_stock_folder(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    src, spec, H = source(tiny_model, "phi")
    first = convert(src, tmp_path / "first", kv_plan=plan_file(tmp_path, [4, 1, 4, 2]))
    for out in (convert(first, tmp_path / "g", num_kv_heads=1),
                convert(first, tmp_path / "plan", kv_plan=plan_file(tmp_path, [1] * LAYERS, "p2.json"))):
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["model_type"] == "phi" and cfg["architectures"] == ["PhiForCausalLM"]
        assert "auto_map" not in cfg and spec.config.kv_heads_list not in cfg and cfg["num_key_value_heads"] == 1
        assert not list(out.glob("gqakit_modeling_*.py"))
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert cache_heads(model) == [1] * LAYERS
        # pooling twice in contiguous groups is pooling once to the final heads
        assert_close_by_rounding(logits(model), logits(reference(src, spec, [1] * LAYERS)), PATH)


def test_sliding_window_layers_keep_their_window(tiny_model, tmp_path):
    """Gemma 2's own layout keeps its attention, sliding window included (the nemotron-nas
    layout, which lacks one, refuses such a source): on a sequence longer than the window the
    per-layer model computes the pooled stock model."""
    src, spec, H = source(tiny_model, "gemma2")
    window = json.loads((src / "config.json").read_text())["sliding_window"]
    plan = [H, 1, 2, 4]
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, plan))
    model = load(out)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == \
        [window if t == "sliding_attention" else None for t in model.config.layer_types]
    assert cache_heads(model) == plan and generated_cache_heads(model) == plan
    ids = torch.randint(3, 64, (1, 3 * window), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, reference(src, spec, plan)(ids).logits
    # the PATH bound with the longer sequence's scores and weighted values
    assert_close_by_rounding(got, want, PATH + LAYERS * 2 * ids.shape[1])


def test_per_layer_k_norm_is_sized_per_layer(tiny_model, tmp_path):
    """OLMo 2's k_norm spans all of a layer's K heads: each layer's has G_l * head_dim weights."""
    src, spec, H = source(tiny_model, "olmo2")
    plan = [H, 1, H, 2]
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, plan))
    model, D = load(out), archmod.shape_of(spec, json.loads((out / "config.json").read_text())).head_dim
    assert [layer.self_attn.k_norm.weight.numel() for layer in model.model.layers] == [g * D for g in plan]


def test_kv_budget_writes_the_familys_own_layout(tiny_model, tmp_path, capsys):
    """--kv-budget on a stock-class family: the chosen per-layer heads in its gqakit folder."""
    from cli_helpers import run_cli
    from test_kv_budget import CALIB

    spec = archmod.registry()["phi3"]
    src = tiny_model("phi3", num_hidden_layers=3, num_key_value_heads=4)
    (tmp_path / "calib.txt").write_text(CALIB)
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", src, out, "--kv-budget", "0.4", "--method", "mean", "--calibration-data",
                            tmp_path / "calib.txt", "--calibration-tokens", "512", "-q"], capsys)
    assert code == 0, err
    heads = json.loads((out / "gqakit_convert.json").read_text())["kv_heads"]
    assert sum(heads) <= 0.4 * 3 * 4 and len(set(heads)) > 1  # 4.8 heads' cache: one layer keeps two
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gqakit_phi3" and cfg[spec.config.kv_heads_list] == heads
    assert cache_heads(load(out)) == heads


def test_eval_and_uptrain_take_a_per_layer_stock_class_output(tiny_model, tmp_path, capsys):
    """Perplexity counts each layer's own cache; uptraining loads the model and keeps the list."""
    from gqakit.cli import main
    from gqakit.uptrain import run_uptrain
    from test_uptrain import cfg as uptrain_cfg

    src, spec, H = source(tiny_model, "phi")
    plan = [4, 1, 4, 2]
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, plan))
    (tmp_path / "d.txt").write_text(" ".join(chr(33 + (i * 7) % 61) for i in range(300)))
    try:
        main(["eval", str(out), "--data", str(tmp_path / "d.txt"), "--context", "32", "--out",
              str(tmp_path / "r.json"), "-q"])
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    model = json.loads((tmp_path / "r.json").read_text())["model"]
    D = archmod.shape_of(spec, json.loads((out / "config.json").read_text())).head_dim
    assert model["kv_bytes_per_token"] == 2 * sum(plan) * D * 4  # float32, each layer its own
    final = run_uptrain(uptrain_cfg(out, tmp_path / "run", tokens=16 * 2 * 1), quiet=True)
    trained = json.loads((final / "config.json").read_text())
    assert trained[spec.config.kv_heads_list] == plan and trained["model_type"] == "gqakit_phi"
    assert cache_heads(load(final)) == plan


def test_vllm_refuses_a_per_layer_stock_class_output_not_a_uniform_one(tiny_model, tmp_path, monkeypatch):
    """vLLM has no class that reads gqakit's per-layer list of these families: refused in one line
    before vLLM starts; their uniform output is the stock folder, which vLLM's own class serves."""
    from gqakit.engines import EngineOptions, get_engine
    from gqakit.engines import vllm as ev

    src, spec, H = source(tiny_model, "phi")
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, [4, 1, 4, 2]))
    monkeypatch.setattr(ev, "find_python", lambda: pytest.fail("vLLM must not start"))
    with pytest.raises(GqakitError, match=r"needs gqakit's modeling file \(gqakit_modeling_phi\.py\)"):
        get_engine("vllm").load(out, EngineOptions())
    uniform = convert(src, tmp_path / "g", num_kv_heads=2)
    assert ev.check_model(uniform) is False  # the stock folder: no code to trust
    # the model cards say so: vLLM is offered for the stock folder only
    assert "vllm serve OUT\n" in (uniform / "README.md").read_text()
    card = (out / "README.md").read_text()
    assert "vllm serve" not in card and "gqakit eval OUT --engine transformers --check" in card


def test_a_per_layer_card_offers_vllm_where_its_class_reads_the_layout(tiny_model, tmp_path):
    """The nemotron-nas folder of a Llama-shaped family: vLLM's own DeciLMForCausalLM serves it."""
    src = tiny_model("llama", num_hidden_layers=LAYERS)
    card = (convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, [8, 1, 8, 2])) / "README.md").read_text()
    assert "vllm serve OUT --trust-remote-code" in card and "gqakit eval OUT --engine vllm --check" in card


@pytest.mark.parametrize("family", ["phi", "qwen3"])
def test_rebuilt_attentions_follow_the_models_attention_implementation(tiny_model, tmp_path, family):
    """A rebuilt layer's attention reads the model's own config at run time: switching the model to
    eager after loading switches every layer, and eager computes what sdpa does."""
    src, spec, H = source(tiny_model, family)
    model = load(convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, [H, 1, H, 2])))
    sdpa = logits(model)
    model.set_attn_implementation("eager")
    assert {layer.self_attn.config._attn_implementation for layer in model.model.layers} == {"eager"}
    assert_close_by_rounding(logits(model), sdpa, PATH)
