"""MPT: fused Wqkv `[q | k | v]`, ALiBi, gqakit's modeling file.

What the registry-driven tests do not cover: a cached `generate` at G = H, the cache at G < H,
mean pooling against a reference written here from the stock layout, ALiBi's rule that every
query head keeps its slope when a grouping moves it, and the configurations refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from gqakit.convert import convert_checkpoint
from gqakit.convert.grouping import GROUPINGS
from gqakit.core.errors import GqakitError
from test_convert import equalize_kv
from test_family_bloom import IDS, generated, load, reversed_groups, verbs_end_to_end

H, D, LAYERS = 4, 8, 2  # tiny_models' mpt: 4 heads of 8 dims, 2 layers
WQKV = "transformer.blocks.{layer}.attn.Wqkv.weight"


def source_heads(src: Path, out: Path) -> list[list[int]]:
    """Per layer, which source query head each output query head is, from the weights (mean
    pooling leaves the query rows as they are)."""
    s, o = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    found = []
    for layer in range(LAYERS):
        name = WQKV.format(layer=layer)
        q_src, q_out = s[name][: H * D].view(H, D, -1), o[name][: H * D].view(H, D, -1)
        found.append([next(i for i in range(H) if torch.equal(q_out[j], q_src[i])) for j in range(H)])
    return found


def stock_slopes() -> list[float]:
    return (-build_mpt_alibi_tensor(H, 2)[:, 0, 0]).tolist()  # the bias one position back is -slope


def test_cached_generate_at_g_equal_h_is_the_original(tiny_model, tmp_path):
    src = tiny_model("mpt")
    out = convert_checkpoint(src, tmp_path / "out", H, progress=False)
    tokens, logits = generated(load(out))
    ref_tokens, ref_logits = generated(load(src))
    assert torch.equal(tokens, ref_tokens)
    # G = H with contiguous groups moves nothing: the same operations on the same weights
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)


@pytest.mark.parametrize("g", [2, 1])
def test_cache_holds_g_heads(tiny_model, tmp_path, g):
    out = convert_checkpoint(tiny_model("mpt"), tmp_path / "out", g, "align", progress=False)
    model = load(out)
    with torch.no_grad():
        cache = model(IDS, use_cache=True).past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == [g] * LAYERS
    assert [layer.values.shape[1] for layer in cache.layers] == [g] * LAYERS
    generated(model)  # decodes with the G-head cache


def test_mean_pooling_equals_a_reference_by_hand(tiny_model, tmp_path):
    src = tiny_model("mpt")
    G, r = 2, H // 2
    out = convert_checkpoint(src, tmp_path / "out", G, "mean", grouping="contiguous", progress=False)
    s, o = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for layer in range(LAYERS):
        name = WQKV.format(layer=layer)
        q, k, v = s[name].view(3, H, D, -1)  # stock rows [q | k | v]
        pool = lambda t: t.view(G, r, D, -1).mean(1)  # noqa: E731  (contiguous groups of r heads)
        expected = torch.cat([q, pool(k), pool(v)]).reshape(-1, s[name].shape[1])
        # one mean of r = 2 float32 values, computed in float64 and rounded once
        torch.testing.assert_close(o[name], expected, rtol=2 ** -23, atol=0)
        proj = f"transformer.blocks.{layer}.attn.out_proj.weight"
        assert torch.equal(o[proj], s[proj])
    assert json.loads((out / "config.json").read_text())["gqakit_query_head_order"] == [list(range(H))] * LAYERS


@pytest.mark.parametrize("method", ["mean", "align"])
def test_each_query_head_keeps_its_slope_when_a_grouping_moves_it(tiny_model, tmp_path, monkeypatch, method):
    monkeypatch.setitem(GROUPINGS, "reversed", reversed_groups)
    src = tiny_model("mpt")
    out = convert_checkpoint(src, tmp_path / "out", H, method, grouping="reversed", progress=False)
    order = json.loads((out / "config.json").read_text())["gqakit_query_head_order"]
    assert order == [list(reversed(range(H)))] * LAYERS
    if method == "mean":
        assert source_heads(src, out) == order  # the recorded order is where the weights went
    model = load(out)
    slopes = stock_slopes()
    assert [[slopes[i] for i in b.attn.head_order] for b in model.transformer.blocks] == \
        [[slopes[i] for i in reversed(range(H))]] * LAYERS
    tokens, logits = generated(model)
    ref_tokens, ref_logits = generated(load(src))
    assert torch.equal(tokens, ref_tokens)
    # the heads are summed in another order by out_proj (H * D = 32 terms), and align rotates
    # each head in float64 before rounding to float32: rounding only
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    for block in model.transformer.blocks:  # the slopes left in head-index order: far outside it
        block.attn.head_order = None
    assert (generated(model)[1] - ref_logits).abs().max() > 10 * 1e-4


def test_align_refit_keeps_the_slopes_of_moved_heads(tiny_model, tmp_path, monkeypatch, one_thread):
    monkeypatch.setitem(GROUPINGS, "reversed", reversed_groups)
    model = load(tiny_model("mpt"))
    equalize_kv(model, "mpt", 2)
    model.save_pretrained(tmp_path / "paired")
    out = convert_checkpoint(tmp_path / "paired", tmp_path / "out", 2, "align-refit", grouping="reversed",
                             calibration_tokens=256, options={"seq_len": 32}, progress=False)
    assert json.loads((out / "config.json").read_text())["gqakit_query_head_order"] == [[2, 3, 0, 1]] * LAYERS
    # the tolerance of test_architectures' align-refit exactness test (float64 fits, float32 streams)
    torch.testing.assert_close(generated(load(out))[1], generated(model)[1], rtol=0, atol=2e-4)


@pytest.mark.parametrize("option", [{"qk_ln": True}, {"alibi": False}, {"attn_type": "multiquery_attention"}])
def test_configurations_transformers_does_not_compute_are_refused(tiny_model, tmp_path, option):
    src = tiny_model("mpt")
    cfg = json.loads((src / "config.json").read_text())
    cfg["attn_config"].update(option)
    (src / "config.json").write_text(json.dumps(cfg))
    key, value = next(iter(option.items()))
    with pytest.raises(GqakitError, match=f"mpt with attn_config.{key}={value} is not supported"):
        convert_checkpoint(src, tmp_path / "out", 2, progress=False)
    assert not (tmp_path / "out").exists()


def test_clip_qkv_is_kept(tiny_model, tmp_path):
    """Clamping the fused output is elementwise: the grouped model clamps the same values."""
    model = load(tiny_model("mpt", attn_config={"clip_qkv": 0.3}))
    equalize_kv(model, "mpt", 2)
    model.save_pretrained(tmp_path / "paired")
    out = convert_checkpoint(tmp_path / "paired", tmp_path / "out", 2, "mean", progress=False)
    converted = load(out)
    assert converted.transformer.blocks[0].attn.clip_qkv == 0.3
    # equal heads pooled (the mean of equal values is exact): test_convert's equal-heads tolerance,
    # for a smaller fused matmul that may block its reductions differently
    torch.testing.assert_close(generated(converted)[1], generated(model)[1], rtol=0, atol=1e-5)


def test_convert_inspect_eval_uptrain_from_the_command_line(tiny_model, tmp_path, capsys):
    verbs_end_to_end("mpt", tiny_model, tmp_path, capsys, lora=True)


def test_the_table_refuses_a_position_bias_without_a_modeling_file_to_read_it():
    """The query head order is read by gqakit's modeling file: a stock class would ignore it."""
    from pydantic import ValidationError

    from gqakit.core.arch import ArchSpec, registry

    entry = registry()["mpt"].model_dump() | {"remote": None}
    with pytest.raises(ValidationError, match="position_bias"):
        ArchSpec.model_validate(entry)
