"""The method seam: the method table and the settings import no torch; a method registered
by a test converts end to end, and LoRA uptraining takes its targets from the record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import toy_method
from gqakit.core.errors import GqakitError
from gqakit.core.methods import METHODS, MethodSpec, register_method

REPO = Path(__file__).resolve().parents[1]

TORCH_FREE = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
from gqakit.convert.settings import ConvertSettings
from gqakit.convert.resolved import resolve_settings
from gqakit.core.methods import METHODS
mean = ConvertSettings(source="m", num_kv_heads=1, method="mean")
refit = ConvertSettings(source="m", num_kv_heads=1, method="align-refit", refit={"steps": 3, "seq_len": 32})
resolved = resolve_settings(refit, source_params=300_000, max_positions=64)
print(",".join(METHODS), mean.refit.given(), refit.refit.steps, resolved.grouping, resolved.options.train)
"""


def test_the_method_table_and_the_settings_import_no_torch():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, env=env,
                         cwd=REPO.parent, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mean,first,random,align,align-scale,align-refit", "{}", "3", "similarity", "block"]


def test_a_method_entry_is_checked_when_registered():
    with pytest.raises(ValueError, match="changes"):
        MethodSpec("bad", changes=("x",), fn=toy_method.toy_first_k)
    with pytest.raises(ValueError, match="per-layer function"):
        MethodSpec("bad", changes=("k",))
    with pytest.raises(GqakitError, match="already registered"):
        register_method(MethodSpec("mean", changes=("k", "v"), fn=toy_method.toy_first_k))
    assert "toy-first-k" not in METHODS


@pytest.fixture
def toy():
    spec = toy_method.register()
    yield spec
    toy_method.unregister()


def test_a_registered_method_converts_end_to_end_and_lora_follows_the_record(toy, tiny_model, tmp_path, capsys):
    from gqakit.cli import main
    from gqakit.uptrain import run_uptrain
    from gqakit.uptrain.lora import default_targets

    src = tiny_model("llama", num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2)
    out = tmp_path / "toy"
    main(["convert", str(src), str(out), "-g", "2", "--method", "toy-first-k", "-q"])
    record = json.loads((out / "gqakit_convert.json").read_text())
    assert record["settings"]["method"] == "toy-first-k" and record["settings"]["grouping"] == "contiguous"
    assert record["changed"] == {"decoder.self_attention": ["k_proj", "v_proj"]}
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    d = before["model.layers.0.self_attn.k_proj.weight"].shape[0] // 4  # head_dim
    for L in range(2):
        for p in ("k_proj", "v_proj"):
            w = before[f"model.layers.{L}.self_attn.{p}.weight"].reshape(4, d, -1)
            torch.testing.assert_close(after[f"model.layers.{L}.self_attn.{p}.weight"],  # copied: exact
                                       w[[0, 2]].reshape(2 * d, -1), rtol=0, atol=0)
        for p in ("q_proj", "o_proj"):
            assert torch.equal(after[f"model.layers.{L}.self_attn.{p}.weight"],
                               before[f"model.layers.{L}.self_attn.{p}.weight"])
    assert "toy-first-k: Toy: keep each contiguous group's first K/V head." in (out / "README.md").read_text()
    # LoRA with no explicit targets: the record's projections, k and v only
    assert default_targets(out) == ["self_attn.k_proj", "self_attn.v_proj"]
    texts = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40)) for i in range(24)]
    final = run_uptrain({
        "model": {"path": str(out)}, "data": {"texts": texts, "eval_texts": texts[:4]},
        "train": {"tokens": 16 * 2 * 4, "seq_len": 16, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 1,
                  "precision": "fp32", "lora": {"r": 2, "alpha": 4}},
        "eval": {"every": 4}, "output": {"dir": str(tmp_path / "run"), "save_every": 4},
        "logging": {"every": 1, "tensorboard": False}}, quiet=True)
    trained = load_file(final / "model.safetensors")
    moved = {k.split(".")[-2] for k in after if not torch.equal(after[k], trained[k].to(after[k].dtype))}
    assert moved == {"k_proj", "v_proj"}


def test_the_plan_carries_settings_resolved_once(tiny_model):
    from gqakit.convert.plan import make_plan
    from gqakit.convert.resolved import ResolvedSettings
    from gqakit.convert.settings import ConvertSettings
    from gqakit.convert.source import open_model

    src = tiny_model("llama", num_key_value_heads=4)
    asked = ConvertSettings(source=src, num_kv_heads=2, method="align-refit", max_shard_size="1MB")
    plan = make_plan(open_model(src), asked)
    got = plan.settings
    assert isinstance(got, ResolvedSettings) and got.asked is asked and asked.grouping == "auto"
    assert (got.grouping, got.output, got.max_shard_bytes, got.dtype) == ("similarity", "folder", 10**6, None)
    assert got.options.steps == round(900 * asked.calibration_tokens / 65536) and got.options.train == "block"
    assert not any(v == "auto" for v in (got.options.seq_len, got.options.steps, got.options.lr, got.options.train))
    assert make_plan(open_model(src), asked, gguf_out=True).settings.options.train == "attention"
