"""`--kv-budget` on pico models: the damage measurement's equivalence (pool, then repeat the
heads back, computes what the converted model computes), the choice (a damaging layer keeps
more heads), the record and card, `inspect --kv-budget`, and bad budgets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from gqakit.convert.budget.choose import choose_kv_heads
from gqakit.convert.budget.damage import repeated
from gqakit.convert.settings import ConvertSettings
from gqakit.convert.source import open_model
from cli_helpers import run_cli

CALIB = "".join(chr(33 + (i * 7919) % 61) + (" " if i % 5 == 4 else "") for i in range(6000))




def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def llama4(tiny_model, tmp_path):
    """A pico Llama with 8 query heads over 4 KV heads (candidates 4, 2, 1), and calibration text."""
    (tmp_path / "calib.txt").write_text(CALIB)
    return tiny_model("llama", num_key_value_heads=4, num_hidden_layers=3), tmp_path / "calib.txt"


def budget(src: Path, calib: Path, b: str, **kw) -> ConvertSettings:
    return ConvertSettings(source=src, kv_budget=b, method="mean", calibration_data=str(calib),
                           calibration_tokens=512, **kw)


def test_repeated_heads_compute_the_converted_model(llama4, tmp_path, one_thread):
    """The measurement's premise: every layer pooled to G=2 and repeated back to 4 gives the
    logits of the converted -g 2 model (float32, same op order but for the repeat: 1e-5)."""
    from transformers import AutoModelForCausalLM

    from gqakit.convert.budget.damage import measure_damage  # noqa: F401  (the module under test imports)
    from gqakit.convert.layout import layer_names, read_heads, write_heads
    from gqakit.convert.pipeline import convert_checkpoint
    from gqakit.convert.pooling import PoolContext, mean_method
    from gqakit.core import arch as archmod

    src, _ = llama4
    out = convert_checkpoint(src, tmp_path / "g2", 2, "mean", progress=False)
    ref = AutoModelForCausalLM.from_pretrained(out).eval()
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    spec = archmod.lookup(json.loads((src / "config.json").read_text()))
    shape = archmod.shape_of(spec, json.loads((src / "config.json").read_text()))
    params = dict(model.named_parameters())
    for layer in range(shape.num_layers):
        names = {n for n in layer_names(spec, layer).values() if n in params}
        heads = read_heads(spec, shape, {n: params[n].detach() for n in names}, layer, dtype=torch.float64)
        new = mean_method(heads, PoolContext(2, [[0, 1], [2, 3]]))
        with torch.no_grad():
            for n, t in write_heads(spec, repeated(new, 2), layer, {n: torch.float32 for n in names}).items():
                params[n].copy_(t)
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # float32 logits of order 1; sums over 32 dims


def test_budget_one_keeps_every_head_and_measures_nothing(llama4):
    src, calib = llama4
    choice = choose_kv_heads(open_model(src, progress=False), budget(src, calib, "1.0"), progress=False)
    assert choice.kv_heads == (4, 4, 4) and choice.uniform == 4 and choice.measured is None
    assert choice.plan_bytes == choice.source_bytes


def test_a_damaging_layer_keeps_more_heads(llama4, tmp_path, one_thread):
    """At the bytes of uniform G=2, the layer whose V and O are scaled up (its pooling error
    reaches the output many times larger) gets 4 heads, paid for by the others."""
    from safetensors.torch import load_file, save_file

    src, calib = llama4
    w = load_file(src / "model.safetensors")
    for n in ("model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        w[n] = w[n] * 6
    save_file(w, src / "model.safetensors", metadata={"format": "pt"})
    choice = choose_kv_heads(open_model(src, progress=False), budget(src, calib, "0.5"), progress=False)
    assert choice.kv_heads[1] == 4 and sum(choice.kv_heads) <= 6, choice.table
    rows = choice.record()["layers"]
    assert rows[1]["damage"]["1"] > rows[0]["damage"]["1"] and rows[1]["damage"]["1"] > rows[2]["damage"]["1"]
    assert rows[1]["why"].startswith("kept every head") and "raises the total damage" in rows[1]["why"]
    assert choice.plan_bytes <= choice.budget_bytes == choice.source_bytes // 2


def test_convert_records_the_plan(llama4, tmp_path, capsys, one_thread, monkeypatch):
    """A budget that fits one head per layer and no more: the only plan is uniform G=1, so nothing
    is measured (no damage pass runs); it is written, recorded and carded as such."""
    from gqakit.convert.budget import choose

    src, calib = llama4
    out = tmp_path / "out"
    passes = []
    real = choose.measure
    monkeypatch.setattr(choose, "measure", lambda *a, **k: passes.append(1) or real(*a, **k))
    code, _, err = run_cli(["convert", src, out, "--kv-budget", "0.25", "--method", "mean", "--calibration-data",
                            calib, "--calibration-tokens", "512", "-q"], capsys)
    assert code == 0, err
    rec = json.loads((out / "gqakit_convert.json").read_text())
    assert rec["num_kv_heads"] == 1 and rec["settings"]["kv_budget"] == "0.25"
    table = rec["kv_budget"]
    assert [r["kv_heads"] for r in table["layers"]] == [1, 1, 1] and "measured" not in table and not passes
    assert all(r["damage"] == {} and "the only plan within the budget" in r["why"] for r in table["layers"])
    assert table["plan_bytes_per_token"] == table["budget_bytes_per_token"] == table["source_bytes_per_token"] // 4
    card = (out / "README.md").read_text()
    assert "| KV budget |" in card and "damage measured" not in card and "the only plan within the budget" in card
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1


def test_a_budget_with_room_for_one_more_head_measures(llama4, tmp_path, capsys, one_thread):
    """One head over the smallest cache: a layer may take 2 heads, so the damages are measured and
    the record and the card name the probe."""
    src, calib = llama4
    out = tmp_path / "out"
    code, _, err = run_cli(["convert", src, out, "--kv-budget", "4/12", "--method", "mean", "--calibration-data",
                            calib, "--calibration-tokens", "512", "-q"], capsys)
    assert code == 0, err
    table = json.loads((out / "gqakit_convert.json").read_text())["kv_budget"]
    assert sorted(r["kv_heads"] for r in table["layers"]) == [1, 1, 2]
    assert set(table["layers"][0]["damage"]) == {"4", "2", "1"} and table["measured"]["method"] == "mean"
    card = (out / "README.md").read_text()
    assert f"each layer's damage measured with {table['measured']['probe']};" in card


@pytest.mark.parametrize(("b", "needle"), [
    ("0.1", "below the smallest possible KV cache of this model: 96 bytes per token"),
    ("64B", "below the smallest possible KV cache"),
    ("1.5", "in (0, 1]"), ("3072", "take a unit"),
    ("1.0", "keeps every KV head"),
])
def test_bad_budgets_write_nothing(llama4, tmp_path, capsys, b, needle):
    src, calib = llama4
    before, out = digest(src), tmp_path / "out"
    code, _, err = run_cli(["convert", src, out, "--kv-budget", b, "--calibration-data", calib, "-q"], capsys)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and digest(src) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))]


def test_g_and_budget_together_is_one_line(llama4, tmp_path, capsys):
    src, _ = llama4
    code, _, err = run_cli(["convert", src, tmp_path / "o", "-g", "2", "--kv-budget", "0.5"], capsys)
    assert code == 2 and "give one" in err and len(err.strip().splitlines()) == 1


def test_inspect_kv_budget_prints_the_plan_and_writes_nothing(llama4, capsys, one_thread):
    src, calib = llama4
    before = digest(src.parent)
    code, out, err = run_cli(["inspect", src, "--kv-budget", "0.5", "--method", "mean", "--calibration-data", calib,
                              "--calibration-tokens", "512", "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)["kv_budget"]
    assert info["budget"] == "0.5" and len(info["layers"]) == 3 and info["plan_bytes_per_token"] <= \
        info["budget_bytes_per_token"]
    assert digest(src.parent) == before
    code, out, err = run_cli(["inspect", src, "--kv-budget", "0.5", "--method", "mean", "--calibration-data", calib,
                              "--calibration-tokens", "512"], capsys)
    assert code == 0 and "KV heads per layer" in out and "damage measured with mean" in out
    code, _, err = run_cli(["inspect", src, "--calibration-tokens", "5"], capsys)
    assert code == 2 and "applies with --kv-budget" in err


def test_a_gguf_out_takes_g_only(llama4, tmp_path, capsys):
    src, _ = llama4
    code, _, err = run_cli(["convert", src, tmp_path / "o.gguf", "--kv-budget", "0.5"], capsys)
    assert code == 2 and "a .gguf OUT takes -g G" in err and not (tmp_path / "o.gguf").exists()


def test_a_budget_conversion_replays_bit_for_bit_from_its_record(llama4, tmp_path, capsys, one_thread):
    """`--kv-plan OUT/gqakit_convert.json` of a per-layer `--kv-budget` output writes the same bytes."""
    src, calib = llama4
    first, again = tmp_path / "first", tmp_path / "again"
    common = ["--method", "mean", "--calibration-data", calib, "--calibration-tokens", "512", "-q"]
    code, _, err = run_cli(["convert", src, first, "--kv-budget", "0.5", *common], capsys)
    assert code == 0, err
    rec = json.loads((first / "gqakit_convert.json").read_text())
    assert len(set(rec["kv_heads"])) > 1  # a per-layer plan, so the replay goes through the per-layer writer
    code, _, err = run_cli(["convert", src, again, "--kv-plan", first / "gqakit_convert.json", *common], capsys)
    assert code == 0, err
    names = ("model.safetensors", "config.json")
    assert {n: digest(first)[n] for n in names} == {n: digest(again)[n] for n in names}


def test_damages_are_measured_on_at_most_damage_tokens(llama4, monkeypatch):
    """The damage passes read at most `DAMAGE_TOKENS` of the calibration text (each runs the whole
    model), whatever --calibration-tokens the conversion itself uses."""
    from gqakit.convert.budget import choose
    from gqakit.convert.source import open_model

    src, calib = llama4
    monkeypatch.setattr(choose, "DAMAGE_TOKENS", 128)
    settings = ConvertSettings(source=src, kv_budget="0.5", method="mean", calibration_data=str(calib),
                               calibration_tokens=512)
    measured = choose.measure(open_model(src, progress=False), settings, progress=False)
    assert 0 < measured.measured["tokens"] <= 128
    monkeypatch.setattr(choose, "DAMAGE_TOKENS", 16_384)
    assert choose.measure(open_model(src, progress=False), settings, progress=False).measured["tokens"] > 128
