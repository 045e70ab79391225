"""Planning a 70B-shaped conversion on torch's meta device: every shape, no memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gqakit.convert.io import DictSource, plan_shards
from gqakit.convert.plan import make_plan
from gqakit.convert.source import Opened
from gqakit.convert.settings import ConvertSettings


def llama70b_mha_source(layers: int = 80, hidden: int = 8192, heads: int = 64, inter: int = 28672,
                        vocab: int = 32000) -> Opened:
    meta = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
    t = {"model.embed_tokens.weight": meta(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            t[f"{p}self_attn.{n}_proj.weight"] = meta(hidden, hidden)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = meta(inter, hidden), meta(inter, hidden)
        t[p + "mlp.down_proj.weight"] = meta(hidden, inter)
        t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = meta(hidden)
    t["model.norm.weight"], t["lm_head.weight"] = meta(hidden), meta(vocab, hidden)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
              "intermediate_size": inter, "vocab_size": vocab, "max_position_embeddings": 8192}
    return Opened(Path("/nonexistent"), None, config, DictSource(t))


def test_plan_70b_shapes_on_meta():
    opened = llama70b_mha_source()
    plan = make_plan(opened, ConvertSettings(source="llama-70b-mha", num_kv_heads=8))
    shapes = {p.name: p.shape for p in plan.tensors}
    assert shapes["model.layers.79.self_attn.k_proj.weight"] == (8 * 128, 8192)
    assert shapes["model.layers.79.self_attn.q_proj.weight"] == (8192, 8192)
    removed = 80 * 2 * (64 - 8) * 128 * 8192
    assert plan.source_params - plan.output_params == removed
    assert plan.source_params > 68e9
    assert plan.shape.kv_bytes_per_token(2, 64) == 8 * plan.shape.kv_bytes_per_token(2, 8) == 2 * 80 * 64 * 128 * 2
    assert plan.shape.max_positions == 8192
    shards = plan_shards(plan.tensors, 5_000_000_000)
    assert all(sum(p.nbytes for p in s) <= 5_000_000_000 for s in shards if len(s) > 1)
    assert sum(len(s) for s in shards) == len(plan.tensors) and 25 <= len(shards) <= 30


def test_plan_steps_cover_the_source_once_in_file_order():
    from gqakit.convert.plan import AttentionLayer, PassThrough

    opened = llama70b_mha_source()
    plan = make_plan(opened, ConvertSettings(source="llama-70b-mha", num_kv_heads=8, method="align"))
    names = opened.source.names()
    walked = [n for s in plan.steps for n in ((s.name,) if isinstance(s, PassThrough) else s.names)]
    assert sorted(walked) == sorted(names) and len(walked) == len(names)
    assert [p.name for p in plan.tensors] == walked  # the output is planned step by step
    firsts = [names.index(s.name if isinstance(s, PassThrough) else s.names[0]) for s in plan.steps]
    assert firsts == sorted(firsts)
    assert [s.layer for s in plan.attention_layers()] == list(range(80))
    assert all(isinstance(s, AttentionLayer) and len(s.names) == 4 for s in plan.attention_layers())
    # mean touches only K and V: q and o are passed through as bytes
    kv = make_plan(opened, ConvertSettings(source="llama-70b-mha", num_kv_heads=8, method="mean"))
    assert {n.rsplit(".", 2)[-2] for s in kv.attention_layers() for n in s.names} == {"k_proj", "v_proj"}


@pytest.mark.parametrize("args, needle", [
    ([], "nothing written (dry run)"),
    (["--method", "nope"], "unknown method 'nope'"),
    (["--grouping", "nope"], "unknown grouping 'nope'"),
    (["--refit-option", "q_ridge=1"], "method align takes no options"),
    (["--method", "align-refit", "--refit-option", "nope=1"], "unknown align-refit option(s) nope"),
    (["--method", "align-refit", "--calibration-data", "/nonexistent/calib.txt"], "calibration data not found"),
])
def test_convert_dry_run_checks_what_a_run_checks(tiny_model, tmp_path, capsys, args, needle):
    from gqakit.cli import main

    src = tiny_model("llama")
    capsys.readouterr()  # building the model printed its own bars
    try:
        main([str(a) for a in ["convert", src, tmp_path / "out", "-g", "2", "--dry-run", *args]])
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    got = capsys.readouterr()
    if needle == "nothing written (dry run)":
        assert code == 0 and needle in got.out
    else:
        assert code == 2 and needle in got.err and len(got.err.strip().splitlines()) == 1, got.err
    assert not (tmp_path / "out").exists()
