"""`--kv-plan`: per-layer KV heads through the conversion, and the per-layer model folder
(the nemotron-nas layout with gqakit's DeciLM modeling file)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gqakit.convert.pipeline import convert_folder
from gqakit.convert.settings import ConvertSettings
from tiny_models import HIDDEN
from tolerance import assert_close_by_rounding

IDS = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
LAYERS, HEADS = 4, 8
PLAN = [8, 1, 8, 2]  # some layers keep every KV head, the others are pooled
# rounding of a forward pass: per layer the q/k/v and o projections (HIDDEN terms each), the
# scores and the weighted values (head_dim and the sequence), the MLP (64), then the head
PATH = LAYERS * (4 * HIDDEN + 2 * IDS.shape[1] + 64) + HIDDEN


def load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def cache_heads(model) -> list[int]:
    with torch.no_grad():
        out = model(IDS, use_cache=True)
    return [layer.keys.shape[1] for layer in out.past_key_values.layers]


def digest(folder: Path, *names: str) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}


def plan_file(tmp_path: Path, heads: list[int], name: str = "plan.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps({"kv_heads": heads}))
    return p


def convert(src: Path, out: Path, **kw) -> Path:
    return convert_folder(ConvertSettings(source=str(src), method="mean", grouping="contiguous", **kw), out)


def pooled_reference(src: Path, plan: list[int]):
    """The source model with layer l's K and V heads mean-pooled in contiguous groups to plan[l]
    and repeated back to the source's heads (written here, apart from gqakit's head math)."""
    model = load(src)
    D = model.config.hidden_size // HEADS
    kv = model.config.num_key_value_heads
    with torch.no_grad():
        for layer, g in zip(model.model.layers, plan):
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                for t in (proj.weight, proj.bias):
                    if t is None:
                        continue
                    rows = t.double().reshape(g, kv // g, D, *t.shape[1:]).mean(1)
                    t.copy_(rows.repeat_interleave(kv // g, dim=0).reshape(t.shape).to(t.dtype))
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_plan_pools_exactly_the_chosen_layers(tiny_model, tmp_path, family):
    src = tiny_model(family, num_hidden_layers=LAYERS)
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, PLAN))
    model = load(out)
    assert type(model).__name__ == "DeciLMForCausalLM"
    assert cache_heads(model) == PLAN  # each layer's cache holds its own KV heads
    assert_close_by_rounding(logits(model), logits(pooled_reference(src, PLAN)), PATH)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "nemotron-nas" and cfg["architectures"] == ["DeciLMForCausalLM"]
    assert [b["attention"]["n_heads_in_group"] for b in cfg["block_configs"]] == [HEADS // g for g in PLAN]
    assert all(b["ffn"]["intermediate_size"] == cfg["intermediate_size"] for b in cfg["block_configs"])
    assert cfg["num_key_value_heads"] == max(PLAN) and (out / "gqakit_modeling_decilm.py").exists()
    record = json.loads((out / "gqakit_convert.json").read_text())
    assert record["kv_heads"] == PLAN and record["settings"]["kv_heads"] == PLAN
    elem = 4  # float32
    assert record["kv_cache_bytes_per_token_after"] == 2 * sum(PLAN) * (HIDDEN // HEADS) * elem


def test_block_configs_read_as_attributes(tiny_model, tmp_path):
    """vLLM reads `config.block_configs[i].attention.n_heads_in_group` as attributes."""
    from transformers import AutoConfig

    out = convert(tiny_model("llama", num_hidden_layers=LAYERS), tmp_path / "out",
                  kv_plan=plan_file(tmp_path, PLAN))
    cfg = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert [HEADS // b.attention.n_heads_in_group for b in cfg.block_configs] == PLAN
    assert not hasattr(cfg.block_configs[0].ffn, "ffn_mult")  # 64 is no DeciLM ffn_mult width
    assert cfg.block_configs[0].ffn.intermediate_size == 64
    # built from its defaults alone (vLLM builds the config class so before reading config.json)
    bare = type(cfg)()
    assert len(bare.block_configs) == bare.num_hidden_layers and bare.kv_heads_of(0) == bare.num_key_value_heads


def test_plan_of_the_source_heads_is_the_source(tiny_model, tmp_path):
    src = tiny_model("llama", num_hidden_layers=LAYERS)
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, [HEADS] * LAYERS), force=True)
    torch.testing.assert_close(logits(load(out)), logits(load(src)), rtol=0, atol=0)  # the same weights
    assert not list(out.glob("*.py"))  # uniform: the stock class


def test_uniform_plan_is_the_g_conversion(tiny_model, tmp_path):
    src = tiny_model("llama", num_hidden_layers=LAYERS)
    a = convert(src, tmp_path / "plan", kv_plan=plan_file(tmp_path, [2] * LAYERS))
    b = convert(src, tmp_path / "g", num_kv_heads=2)
    assert digest(a, "model.safetensors", "config.json") == digest(b, "model.safetensors", "config.json")


def test_recorded_plan_replays_bit_for_bit(tiny_model, tmp_path):
    src = tiny_model("llama", num_hidden_layers=LAYERS)
    first = convert(src, tmp_path / "first", kv_plan=plan_file(tmp_path, PLAN))
    again = convert(src, tmp_path / "again", kv_plan=first / "gqakit_convert.json")
    assert digest(first, "model.safetensors", "config.json") == digest(again, "model.safetensors", "config.json")


def test_second_conversion_reads_per_layer_model(tiny_model, tmp_path):
    src = tiny_model("llama", num_hidden_layers=LAYERS)
    first = convert(src, tmp_path / "first", kv_plan=plan_file(tmp_path, PLAN))
    second = convert(first, tmp_path / "second", kv_plan=plan_file(tmp_path, [4, 1, 2, 1], "p2.json"))
    assert cache_heads(load(second)) == [4, 1, 2, 1]
    # pooling twice in contiguous groups is pooling once to the final heads
    assert_close_by_rounding(logits(load(second)), logits(pooled_reference(src, [4, 1, 2, 1])), PATH)
    same = convert(first, tmp_path / "same", num_kv_heads=1)  # -g on a per-layer source: every layer
    assert cache_heads(load(same)) == [1] * LAYERS


@pytest.mark.parametrize("heads, needle", [
    ([8, 1, 8], "gives 3 layers' KV heads, but SRC has 4"),
    ([8, 3, 8, 2], "layer 2: 3 KV heads do not divide its 8"),
    ([8, 16, 8, 2], "layer 2: 16 KV heads do not divide its 8"),
])
def test_bad_plans_one_line_nothing_written(tiny_model, tmp_path, capsys, heads, needle):
    from test_convert_errors import assert_one_line_error, run_cli

    src = tiny_model("llama", num_hidden_layers=LAYERS)
    code, err = run_cli(["convert", src, tmp_path / "out", "--kv-plan", plan_file(tmp_path, heads)], capsys)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "out").exists()


def test_family_without_per_layer_layout_refused_with_nearest_uniform(tiny_model, tmp_path, capsys, monkeypatch):
    from gqakit.core import arch as archmod
    from test_convert_errors import assert_one_line_error, run_cli

    # every decoder-only family of the table has a per-layer layout: an entry without one (no
    # `per_layer_kv`), as a newly added family may be, stands in for it
    table = archmod.registry()
    monkeypatch.setitem(table, "phi", table["phi"].model_copy(update={"per_layer_kv": None}))
    src = tiny_model("phi", num_hidden_layers=LAYERS)
    code, err = run_cli(["convert", src, tmp_path / "out", "--kv-plan", plan_file(tmp_path, [4, 1, 4, 2])], capsys)
    # 4 query heads of 8 dims: the plan holds 11 heads over 4 layers (704 B/token in float32),
    # uniform G = 2 (8 heads) is nearest
    assert_one_line_error(code, err, "one KV head count for every layer", "-g 2 (512 B/token (float32)",
                          "the plan: 704 B/token")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, needle", [
    (["-g", "2", "--kv-plan", "PLAN"], "both set the KV heads"),
    ([], "or --kv-plan plan.json"),
    (["--kv-plan", "MISSING"], "no such file"),
    (["--kv-plan", "EMPTY"], 'holds no "kv_heads" list'),
])
def test_plan_option_errors(tiny_model, tmp_path, capsys, args, needle):
    from test_convert_errors import assert_one_line_error, run_cli

    src = tiny_model("llama", num_hidden_layers=LAYERS)
    (tmp_path / "empty.json").write_text("{}")
    files = {"PLAN": str(plan_file(tmp_path, PLAN)), "MISSING": str(tmp_path / "none.json"),
             "EMPTY": str(tmp_path / "empty.json")}
    code, err = run_cli(["convert", src, tmp_path / "out", *[files.get(a, a) for a in args]], capsys)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "out").exists()


def test_cli_writes_per_layer_folder(tiny_model, tmp_path, capsys):
    from test_convert_errors import run_cli

    src = tiny_model("llama", num_hidden_layers=LAYERS)
    capsys.readouterr()  # the tiny model's own save
    code, err = run_cli(["convert", src, tmp_path / "out", "--kv-plan", plan_file(tmp_path, PLAN), "-q"], capsys)
    assert code == 0 and err == ""
    assert cache_heads(load(tmp_path / "out")) == PLAN


def test_inspect_and_dry_run_of_a_per_layer_model(tiny_model, tmp_path, capsys):
    from test_convert_errors import run_cli

    out = convert(tiny_model("llama", num_hidden_layers=LAYERS), tmp_path / "out", kv_plan=plan_file(tmp_path, PLAN))
    capsys.readouterr()
    from gqakit.cli import main

    try:
        main(["inspect", str(out), "--json"])
    except SystemExit as e:
        assert e.code in (0, None)
    info = json.loads(capsys.readouterr().out)
    assert info["kv_heads"] == PLAN and [r["kv_heads"] for r in info["options"]] == [1]  # G every layer can take
    code, err = run_cli(["convert", out, tmp_path / "dry", "-g", "1", "--dry-run"], capsys)
    assert code == 0, err
    assert not (tmp_path / "dry").exists()
    card = (out / "README.md").read_text()
    assert "per layer [8, 8, 8, 8] → [8, 1, 8, 2]" in card and str(tmp_path) not in card  # no local path


def test_calibration_stage_follows_the_plan(tiny_model, tmp_path):
    """align-refit (the calibration stage, block by block) converts each layer to its own heads."""
    src = tiny_model("llama", num_hidden_layers=LAYERS)
    settings = ConvertSettings(source=str(src), kv_plan=plan_file(tmp_path, PLAN), method="align-refit",
                               effort="fast", calibration_tokens=256, refit={"seq_len": 32})
    out = convert_folder(settings, tmp_path / "out", device="cpu")
    model = load(out)
    assert cache_heads(model) == PLAN
    assert torch.isfinite(logits(model)).all()
    drift = json.loads((out / "gqakit_convert.json").read_text())["calibration"]["residual_drift"]
    # layer 1 keeps all 8 heads (no drift after it, up to float64 rounding); layer 2 pools them to 1
    assert drift[0] == pytest.approx(0, abs=1e-12) and drift[1] > 1e-3


@pytest.mark.parametrize("train", ["block", "attention"])
def test_reconstruction_steps_only_where_the_plan_pools(tiny_model, tmp_path, train, capsys):
    """align-refit's steps run in the layers whose KV heads are pooled, none in a layer that keeps
    them (as -g at the source's heads takes none); with train=block a kept layer's MLP and norms
    are the source's bytes, a pooled layer's are retrained. The dry run counts the steps so."""
    from safetensors.torch import load_file

    from cli_helpers import run_cli

    src = tiny_model("llama", num_hidden_layers=LAYERS)
    plan = plan_file(tmp_path, PLAN)
    settings = ConvertSettings(source=str(src), kv_plan=plan, method="align-refit", calibration_tokens=256,
                               refit={"seq_len": 32, "steps": 4, "train": train})
    out = convert_folder(settings, tmp_path / "out", device="cpu")
    rec = json.loads((out / "gqakit_convert.json").read_text())["calibration"]["reconstruction"]
    pooled = [L for L, g in enumerate(PLAN) if g < HEADS]
    assert [r["layer"] for r in rec] == pooled and all(r["steps_taken"] == 4 for r in rec)
    got, was = load_file(str(next(out.glob("*.safetensors")))), load_file(str(next(src.glob("*.safetensors"))))
    for L in range(LAYERS):
        name = f"model.layers.{L}.mlp.up_proj.weight"
        same = torch.equal(got[name], was[name])
        assert same == (L not in pooled or train == "attention"), (L, train)
    code, text, err = run_cli(["convert", src, tmp_path / "dry", "--kv-plan", plan, "--method", "align-refit",
                               "--calibration-tokens", "256", "--refit-option", "seq_len=32",
                               "--refit-option", "steps=4", "--dry-run"], capsys)
    assert code == 0, err
    assert f"4 steps in each of {len(pooled)} layers" in text + err


def test_sliding_window_refused_for_a_per_layer_plan(tiny_model, tmp_path, capsys):
    from test_convert_errors import assert_one_line_error, run_cli

    src = tiny_model("mistral", num_hidden_layers=LAYERS, sliding_window=16)  # shorter than the 128 positions
    capsys.readouterr()
    code, err = run_cli(["convert", src, tmp_path / "out", "--kv-plan", plan_file(tmp_path, PLAN)], capsys)
    assert_one_line_error(code, err, "sliding window (16)", "the nearest uniform plan is -g 4")
    assert not (tmp_path / "out").exists()


def test_a_sliding_window_that_no_layer_uses_is_not_refused(tiny_model, tmp_path):
    """A Qwen2 config.json may keep `sliding_window` with `use_sliding_window` off: no layer
    slides, so a per-layer plan is written (and with it on, the plan is refused)."""
    from gqakit.core.errors import GqakitError

    src = tiny_model("qwen2", num_hidden_layers=LAYERS, use_sliding_window=False)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "sliding_window": 16}))  # as Qwen's own configs keep it
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, PLAN))
    assert json.loads((out / "config.json").read_text())["model_type"] == "nemotron-nas"
    slid = tiny_model("qwen2", num_hidden_layers=LAYERS, sliding_window=16, use_sliding_window=True, max_window_layers=0)
    with pytest.raises(GqakitError, match=r"sliding window \(16\)"):
        convert(slid, tmp_path / "out2", kv_plan=plan_file(tmp_path, PLAN, "p2.json"))
    assert not (tmp_path / "out2").exists()
