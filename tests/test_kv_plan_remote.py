"""`--kv-plan` for the families whose own layout takes per-layer KV heads through gqakit's
modeling file (the table's `per_layer_kv` is the family itself, `config.kv_heads_list` its config
key): the families without GQA in stock transformers, and those on a stock GQA class that is not
Llama-shaped (`remote.per_layer_only`: their modeling file is written for a per-layer output
only). The output is the family's gqakit folder plus each layer's KV heads as a list, and each
attention sizes its K/V and its cache from its own layer's entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError
from test_kv_plan import IDS, cache_heads, convert, digest, load, logits, plan_file
from tiny_models import HIDDEN
from tolerance import assert_close_by_rounding

pytestmark = pytest.mark.usefixtures("one_thread")

OWN = sorted(f for f, s in archmod.registry().items() if s.per_layer_kv == f and s.config.kv_heads_list)
LAYERS = 4
# rounding of a forward pass: per layer the q/k/v and o projections (HIDDEN terms each), the
# scores and the weighted values (head_dim and the sequence), the MLP (at most 4 * HIDDEN wide
# in these pico models), then the head
PATH = LAYERS * (4 * HIDDEN + 2 * IDS.shape[1] + 4 * HIDDEN) + HIDDEN


def test_the_remote_families_take_a_per_layer_plan():
    assert {"gpt2", "gpt_neox", "opt"} <= set(OWN)
    # the stock-class families that are not Llama-shaped: their own layout, not nemotron-nas
    assert {"phi", "phi3", "gemma", "gemma2", "olmo", "olmo2", "qwen3", "stablelm"} <= set(OWN)


def source(tiny_model, family: str) -> tuple[Path, archmod.ArchSpec, int]:
    """A pico model of `family` with LAYERS layers, its table entry and its query heads."""
    spec = archmod.registry()[family]
    src = tiny_model(family, **{spec.config.num_layers: LAYERS})
    return src, spec, json.loads((src / "config.json").read_text())[spec.config.num_heads]


def reference(src: Path, spec: archmod.ArchSpec, plan: list[int]):
    """The stock source model with layer l's K/V heads mean-pooled to plan[l] in contiguous
    groups and repeated back to the source's heads (the function the converted model computes,
    in the stock class and shapes)."""
    from transformers import AutoModelForCausalLM

    from gqakit.convert.budget.damage import apply_plan

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    shape = archmod.shape_of(spec, json.loads((src / "config.json").read_text()))
    apply_plan(model, spec, shape, plan, method="mean")
    return model


def generated_cache_heads(model) -> list[int]:
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                             use_cache=True, pad_token_id=0)
    return [layer.keys.shape[1] for layer in out.past_key_values.layers]


@pytest.mark.parametrize("family", OWN)
def test_plan_pools_exactly_the_chosen_layers(tiny_model, tmp_path, family):
    from gqakit.core.loaded import loaded_shape

    src, spec, H = source(tiny_model, family)
    plan = [H, 1, H, 2]  # some layers keep every KV head, the others are pooled
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, plan))
    model = load(out)
    assert type(model).__name__ == spec.remote.model_class
    assert cache_heads(model) == plan and generated_cache_heads(model) == plan  # each layer caches its own heads
    assert_close_by_rounding(logits(model), logits(reference(src, spec, plan)), PATH)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == f"gqakit_{family}" and cfg["architectures"] == [spec.remote.model_class]
    assert cfg[spec.config.kv_heads_list] == plan and cfg["num_key_value_heads"] == H
    assert (out / f"gqakit_modeling_{family}.py").exists() and not (out / "gqakit_modeling_decilm.py").exists()
    # every stage reads the shape back: from config.json and from the loaded model
    assert archmod.shape_of(spec, cfg).kv_heads_per_layer == tuple(plan)
    assert loaded_shape(model.config).kv_heads_per_layer == tuple(plan)
    record = json.loads((out / "gqakit_convert.json").read_text())
    assert record["kv_heads"] == plan and "trust_remote_code=True" in record["loads_with"]
    D = archmod.shape_of(spec, cfg).head_dim  # gemma's pico model: 16, not HIDDEN / H
    assert record["kv_cache_bytes_per_token_after"] == 2 * sum(plan) * D * 4  # float32


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "opt"])
def test_uniform_plan_is_the_g_conversion(tiny_model, tmp_path, family):
    src, spec, H = source(tiny_model, family)
    a = convert(src, tmp_path / "plan", kv_plan=plan_file(tmp_path, [2] * LAYERS))
    b = convert(src, tmp_path / "g", num_kv_heads=2)
    assert digest(a, "model.safetensors", "config.json") == digest(b, "model.safetensors", "config.json")
    assert spec.config.kv_heads_list not in json.loads((a / "config.json").read_text())


def test_second_conversion_reads_per_layer_output(tiny_model, tmp_path):
    src, spec, H = source(tiny_model, "gpt2")
    first = convert(src, tmp_path / "first", kv_plan=plan_file(tmp_path, [4, 1, 4, 2]))
    second = convert(first, tmp_path / "second", kv_plan=plan_file(tmp_path, [2, 1, 2, 1], "p2.json"))
    assert cache_heads(load(second)) == [2, 1, 2, 1]
    # pooling twice in contiguous groups is pooling once to the final heads
    assert_close_by_rounding(logits(load(second)), logits(reference(src, spec, [2, 1, 2, 1])), PATH)
    same = convert(first, tmp_path / "same", num_kv_heads=1)  # -g on a per-layer source: every layer
    assert cache_heads(load(same)) == [1] * LAYERS
    # a uniform output of a converted source keeps no stale list
    again = convert(first, tmp_path / "again", kv_plan=plan_file(tmp_path, [1] * LAYERS, "p3.json"))
    assert cache_heads(load(again)) == [1] * LAYERS
    cfg = json.loads((again / "config.json").read_text())
    assert spec.config.kv_heads_list not in cfg and cfg["num_key_value_heads"] == 1


def test_gguf_output_of_a_per_layer_plan_is_refused(tiny_model, tmp_path, capsys):
    from gqakit.convert.geometry_check import layer_kv_heads
    from gqakit.convert.settings import ConvertSettings
    from test_convert_errors import assert_one_line_error, run_cli

    src, spec, H = source(tiny_model, "gpt2")
    plan = plan_file(tmp_path, [4, 1, 4, 2])
    code, err = run_cli(["convert", src, tmp_path / "out.gguf", "--kv-plan", plan], capsys)
    assert_one_line_error(code, err, ".gguf")
    assert not list(tmp_path.glob("out*"))
    # the plan itself: only llama.cpp's deci architecture takes per-layer heads
    cfg = json.loads((src / "config.json").read_text())
    for family in OWN:
        spec = archmod.registry()[family]
        with pytest.raises(GqakitError, match="per-layer GGUF is llama.cpp's deci .* nearest uniform plan is -g"):
            layer_kv_heads(spec, archmod.Shape(LAYERS, 4, 4, 8, HIDDEN, 0, 128, None),
                           ConvertSettings(source=str(src), kv_plan=plan), cfg, gguf_out=True)


@pytest.mark.parametrize("bad, needle", [
    ([4, 1, 4], "has 3 entries for 4 layers"),
    ([4, 3, 4, 2], r"num_key_value_heads_per_layer\[1\] = 3 must divide the 4 query heads"),
    ("4,1", "must be a list"),
])
def test_a_bad_list_is_one_line(tiny_model, bad, needle):
    src, spec, H = source(tiny_model, "gpt2")
    cfg = {**json.loads((src / "config.json").read_text()), spec.config.kv_heads_list: bad}
    with pytest.raises(GqakitError, match=needle):
        archmod.shape_of(spec, cfg)


@pytest.mark.parametrize("family", OWN)
def test_config_class_checks_the_list(family, tmp_path):
    """Each modeling file's config refuses a list that does not fit its model; without one every
    layer has num_key_value_heads."""
    import importlib

    spec = archmod.registry()[family]
    module = importlib.import_module(f"gqakit.convert.remote.gqakit_modeling_{family}")
    config_class = getattr(module, spec.remote.config_class)
    base = config_class()
    H, L = base.num_attention_heads, base.num_hidden_layers
    assert [module.kv_heads_at(base, i) for i in range(L)] == [base.num_key_value_heads] * L
    ok = config_class(num_key_value_heads=H, num_key_value_heads_per_layer=[H] + [1] * (L - 1))
    assert ok.num_key_value_heads == H and module.kv_heads_at(ok, 1) == 1
    if getattr(config_class, "num_key_value_heads", None) is None:  # no default count: the list's largest
        assert config_class(num_key_value_heads_per_layer=[H] + [1] * (L - 1)).num_key_value_heads == H
    for bad in ([H] * (L - 1), [H] + [0] * (L - 1), [H // 2] + [1] * (L - 1)):  # the last: its largest is not H
        with pytest.raises(ValueError, match="num_key_value_heads_per_layer"):
            config_class(num_key_value_heads=H, num_key_value_heads_per_layer=bad)


def test_eval_and_uptrain_take_the_per_layer_output(tiny_model, tmp_path, capsys):
    """Perplexity's results file counts each layer's own cache; uptraining loads the model and
    keeps the list."""
    from gqakit.cli import main
    from gqakit.uptrain import run_uptrain
    from test_uptrain import cfg as uptrain_cfg

    src, spec, H = source(tiny_model, "gpt_neox")
    plan = [4, 1, 4, 2]
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, plan))
    text = " ".join(chr(33 + (i * 7) % 61) for i in range(300))
    (tmp_path / "d.txt").write_text(text)
    try:
        main(["eval", str(out), "--data", str(tmp_path / "d.txt"), "--context", "32", "--out",
              str(tmp_path / "r.json"), "-q"])
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    model = json.loads((tmp_path / "r.json").read_text())["model"]
    assert model["kv_bytes_per_token"] == 2 * sum(plan) * (HIDDEN // H) * 4  # float32, each layer its own
    final = run_uptrain(uptrain_cfg(out, tmp_path / "run", tokens=16 * 2 * 1), quiet=True)
    trained = json.loads((final / "config.json").read_text())
    assert trained[spec.config.kv_heads_list] == plan
    assert cache_heads(load(final)) == plan


def test_vllm_refuses_a_per_layer_remote_output_before_starting(tiny_model, tmp_path, monkeypatch):
    """vLLM has no class for gqakit's remote families, per-layer or not: refused in one line
    before vLLM starts (docs/serving.md)."""
    from gqakit.engines import EngineOptions, get_engine
    from gqakit.engines import vllm as ev

    src, spec, H = source(tiny_model, "opt")
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, [4, 1, 4, 2]))
    monkeypatch.setattr(ev, "find_python", lambda: pytest.fail("vLLM must not start"))
    with pytest.raises(GqakitError, match=r"needs gqakit's modeling file \(gqakit_modeling_opt\.py\)"):
        get_engine("vllm").load(out, EngineOptions())
