"""`gqakit eval --speed` on models whose layers have different KV heads (a `--kv-plan` output in
the nemotron-nas layout and in a gqakit modeling file's own layout): every engine that times
decode steps allocates each layer's cache with that layer's own heads, and the bytes it prices
are the plan's."""

from __future__ import annotations

import json

import pytest

from cli_helpers import run_cli
from test_kv_plan import convert, plan_file

pytestmark = pytest.mark.usefixtures("one_thread")

SPEED = ["--speed", "--batch", "1", "--prompt-len", "6", "--new-tokens", "3", "--reps", "2", "--warmup", "1"]


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
@pytest.mark.parametrize("engine", ["gqakit", "transformers"])
def test_speed_runs_on_a_per_layer_model(tiny_model, tmp_path, capsys, family, engine):
    src = tiny_model(family, num_hidden_layers=4)
    cfg = json.loads((src / "config.json").read_text())
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    plan = [kv, 1, kv, 2]
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, plan))
    report = tmp_path / "speed.json"
    code, stdout, err = run_cli(["eval", out, *SPEED, "--engine", engine, "--out", report], capsys)
    assert code == 0, stdout + err
    speed = json.loads(report.read_text())["speed"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert speed["kv_bytes_per_token"] == 2 * sum(plan) * head_dim * 4  # float32 K and V of each layer's heads
    assert speed["grid"] and all(g["status"] == "ok" for g in speed["grid"])
    assert all(min(g["decode_s"]) > 0 for g in speed["grid"] if "decode_s" in g)
