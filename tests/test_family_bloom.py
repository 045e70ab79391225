"""BLOOM: per-head fused query_key_value, ALiBi, gqakit's modeling file.

What the registry-driven tests (test_architectures.py, test_convert.py) do not cover: a cached
`generate` at G = H, the cache at G < H, mean pooling against a reference written here from the
stock layout, and ALiBi's rule that every query head keeps its slope when a grouping moves it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

from gqakit.convert import convert_checkpoint
from gqakit.convert.grouping import GROUPINGS
from test_convert import equalize_kv

H, D, LAYERS = 4, 8, 2  # tiny_models' bloom: 4 heads of 8 dims, 2 layers
IDS = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
QKV = "transformer.h.{layer}.self_attention.query_key_value"


def load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def generated(model, ids=IDS[:1]):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def reversed_groups(h, num_groups, **_):
    """A grouping that moves every head: the groups of `contiguous`, in reverse order."""
    r = h.num_kv_heads // num_groups
    return [list(range(g * r, (g + 1) * r)) for g in reversed(range(num_groups))]


def source_heads(src: Path, out: Path) -> list[list[int]]:
    """Per layer, which source query head each output query head is, found from the weights
    (mean pooling leaves the query rows as they are, so each output head's rows are one
    source head's rows)."""
    s, o = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    G = json.loads((out / "config.json").read_text())["num_key_value_heads"]
    found = []
    for layer in range(LAYERS):
        name = QKV.format(layer=layer) + ".weight"
        q_src = s[name].view(H, 3, D, -1)[:, 0]
        q_out = o[name].view(G, H // G + 2, D, -1)[:, : H // G].reshape(H, D, -1)
        found.append([next(i for i in range(H) if torch.equal(q_out[j], q_src[i])) for j in range(H)])
    return found


def slopes_used(model) -> list[list[float]]:
    """The ALiBi slope each query head of each layer gets in the loaded model."""
    stock = _get_alibi_slopes(H, torch.device("cpu")).tolist()
    return [[stock[i] for i in (block.self_attention.head_order or range(H))] for block in model.transformer.h]


def test_cached_generate_at_g_equal_h_is_the_original(tiny_model, tmp_path):
    src = tiny_model("bloom")
    out = convert_checkpoint(src, tmp_path / "out", H, progress=False)
    tokens, logits = generated(load(out))
    ref_tokens, ref_logits = generated(load(src))
    assert torch.equal(tokens, ref_tokens)
    # G = H with contiguous groups moves nothing: the same operations on the same weights
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)


@pytest.mark.parametrize("g", [2, 1])
def test_cache_holds_g_heads(tiny_model, tmp_path, g):
    out = convert_checkpoint(tiny_model("bloom"), tmp_path / "out", g, "align", progress=False)
    model = load(out)
    with torch.no_grad():
        cache = model(IDS, use_cache=True).past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == [g] * LAYERS
    assert [layer.values.shape[1] for layer in cache.layers] == [g] * LAYERS
    generated(model)  # decodes with the G-head cache


def test_mean_pooling_equals_a_reference_by_hand(tiny_model, tmp_path):
    src = tiny_model("bloom")
    G, r = 2, H // 2
    out = convert_checkpoint(src, tmp_path / "out", G, "mean", grouping="contiguous", progress=False)
    s, o = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for layer in range(LAYERS):
        for kind in ("weight", "bias"):
            name = f"{QKV.format(layer=layer)}.{kind}"
            t = s[name].view(H, 3, D, *s[name].shape[1:])  # stock rows: per head q, k, v
            want = []
            for g in range(G):  # rows (G, r + 2, D): the group's r query heads, then its mean K, mean V
                want += [t[h, 0] for h in range(g * r, (g + 1) * r)]
                want += [t[g * r:(g + 1) * r, 1].mean(0), t[g * r:(g + 1) * r, 2].mean(0)]
            expected = torch.stack(want).reshape(-1, *s[name].shape[1:])
            # one mean of r = 2 float32 values, computed in float64 and rounded once
            torch.testing.assert_close(o[name], expected, rtol=2 ** -23, atol=0)
        dense = f"transformer.h.{layer}.self_attention.dense.weight"
        assert torch.equal(o[dense], s[dense])
    assert json.loads((out / "config.json").read_text())["gqakit_query_head_order"] == [list(range(H))] * LAYERS


@pytest.mark.parametrize("method", ["mean", "align"])
def test_each_query_head_keeps_its_slope_when_a_grouping_moves_it(tiny_model, tmp_path, monkeypatch, method):
    """At G = H a grouping that reverses the heads keeps the function only if every query
    head takes its slope along; the slopes the model uses are the source heads' own."""
    monkeypatch.setitem(GROUPINGS, "reversed", reversed_groups)
    src = tiny_model("bloom")
    out = convert_checkpoint(src, tmp_path / "out", H, method, grouping="reversed", progress=False)
    order = json.loads((out / "config.json").read_text())["gqakit_query_head_order"]
    assert order == [list(reversed(range(H)))] * LAYERS
    model, ref = load(out), load(src)
    if method == "mean":
        assert source_heads(src, out) == order  # the recorded order is where the weights went
    stock = _get_alibi_slopes(H, torch.device("cpu")).tolist()
    assert slopes_used(model) == [[stock[i] for i in reversed(range(H))]] * LAYERS
    tokens, logits = generated(model)
    ref_tokens, ref_logits = generated(ref)
    assert torch.equal(tokens, ref_tokens)
    # the heads are summed in another order by the dense projection (H * D = 32 terms), and
    # align rotates each head in float64 before rounding to float32: rounding only
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    # the same weights with the slopes left in head-index order: far outside that tolerance
    for block in model.transformer.h:
        block.self_attention.head_order = None
    assert (generated(model)[1] - ref_logits).abs().max() > 10 * 1e-4


def test_similarity_grouping_records_where_each_query_head_went(tiny_model, tmp_path):
    src = tiny_model("bloom")
    model = load(src)
    # K/V heads 0 and 2, 1 and 3 equal: similarity pairs them, which moves query heads
    with torch.no_grad():
        for block in model.transformer.h:
            w = block.self_attention.query_key_value
            for t in (w.weight, w.bias):
                v = t.view(H, 3, D, *t.shape[1:])
                v[2, 1:] = v[0, 1:]
                v[3, 1:] = v[1, 1:]
    model.save_pretrained(tmp_path / "paired")
    out = convert_checkpoint(tmp_path / "paired", tmp_path / "out", 2, "mean", grouping="similarity",
                             progress=False)
    order = json.loads((out / "config.json").read_text())["gqakit_query_head_order"]
    assert order == [[0, 2, 1, 3]] * LAYERS == source_heads(tmp_path / "paired", out)
    torch.testing.assert_close(generated(load(out))[1], generated(model)[1], rtol=0, atol=1e-4)


def test_align_refit_keeps_the_slopes_of_moved_heads(tiny_model, tmp_path, monkeypatch, one_thread):
    """The calibration stage runs the stock block on the converted heads: it puts them back at
    their source index, so the stock slopes stay right, and fits o_proj in the heads' order."""
    monkeypatch.setitem(GROUPINGS, "reversed", reversed_groups)
    model = load(tiny_model("bloom"))
    equalize_kv(model, "bloom", 2)
    model.save_pretrained(tmp_path / "paired")
    out = convert_checkpoint(tmp_path / "paired", tmp_path / "out", 2, "align-refit", grouping="reversed",
                             calibration_tokens=256, options={"seq_len": 32}, progress=False)
    assert json.loads((out / "config.json").read_text())["gqakit_query_head_order"] == [[2, 3, 0, 1]] * LAYERS
    # the tolerance of test_architectures' align-refit exactness test (float64 fits, float32 streams)
    torch.testing.assert_close(generated(load(out))[1], generated(model)[1], rtol=0, atol=2e-4)


TEXTS = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40 + i % 9)) for i in range(24)]


@pytest.mark.parametrize("lora", [False, True])
def test_convert_inspect_eval_uptrain_from_the_command_line(tiny_model, tmp_path, capsys, lora):
    verbs_end_to_end("bloom", tiny_model, tmp_path, capsys, lora)


def verbs_end_to_end(family, tiny_model, tmp_path, capsys, lora):
    """The verbs end to end; uptraining keeps the query head order (its model has the same heads)."""
    from gqakit.cli import main
    from gqakit.uptrain import run_uptrain

    def run(*args) -> str:
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            assert exc.code in (0, None), capsys.readouterr().err
        return capsys.readouterr().out

    src, out = tiny_model(family), tmp_path / "g2"
    run("convert", src, out, "--num-kv-heads", 2, "--method", "align", "--grouping", "similarity", "-q")
    order = json.loads((out / "config.json").read_text())["gqakit_query_head_order"]
    assert order != [list(range(H))] * LAYERS  # similarity moves query heads in this model
    assert family in run("inspect", out) and "KV heads 2" in run("inspect", out)
    (tmp_path / "text.txt").write_text("\n".join(TEXTS))
    run("eval", out, "--data", tmp_path / "text.txt", "--context", 32, "--out", tmp_path / "res.json", "-q")
    assert json.loads((tmp_path / "res.json").read_text())["perplexity"]["token_perplexity"] > 1
    train = {"tokens": 16 * 2 * 4, "seq_len": 16, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 1,
             "precision": "fp32", **({"lora": {"r": 4, "alpha": 8}} if lora else {})}
    final = run_uptrain({"model": {"path": str(out)}, "data": {"texts": TEXTS}, "train": train,
                         "output": {"dir": str(tmp_path / "run"), "save_every": 4},
                         "logging": {"every": 1, "tensorboard": False}}, quiet=True)
    assert json.loads((final / "config.json").read_text())["gqakit_query_head_order"] == order
    model = load(final)
    with torch.no_grad():
        cache = model(IDS, use_cache=True).past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == [2] * LAYERS


def test_a_second_conversion_composes_the_orders(tiny_model, tmp_path, monkeypatch):
    """Converting a converted model: the recorded order still names the original heads."""
    monkeypatch.setitem(GROUPINGS, "reversed", reversed_groups)
    src = tiny_model("bloom")
    once = convert_checkpoint(src, tmp_path / "once", H, "mean", grouping="reversed", progress=False)
    twice = convert_checkpoint(once, tmp_path / "twice", 2, "mean", grouping="reversed", progress=False)
    # the second reversal of two groups of two puts heads (3, 2 | 1, 0) back as (1, 0 | 3, 2)
    assert json.loads((twice / "config.json").read_text())["gqakit_query_head_order"] == [[1, 0, 3, 2]] * LAYERS
    assert source_heads(src, twice) == [[1, 0, 3, 2]] * LAYERS
