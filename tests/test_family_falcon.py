"""Falcon, the multi-head variants: the original decoder (Falcon-RW: per-head [q, k, v] rows,
ALiBi) and the new decoder architecture (grouped rows, rotary, parallel attention).

What the family-wide tests (test_architectures.py, test_convert.py, test_remote_modeling.py:
the pico falcon there is Falcon-RW's layout) do not cover: both layouts through a cached
`generate`, the cache's head count, mean pooling against a reference written here from the
stock rows, ALiBi's slopes staying with their query heads when a grouping moves them
(`gqakit_query_head_order`, read only with ALiBi on), the stock new-architecture
class (which caches K/V broadcast to every query head) against gqakit's, and the verbs end
to end (inspect, eval, uptrain).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gqakit.convert import convert_checkpoint
from gqakit.core.errors import GqakitError
from test_cli_refusals_and_help import run_cli
from test_convert import load, logits

TARGETS = ("query_key_value",)  # what a mean conversion changed: LoRA adapts it
H, D, LAYERS = 4, 8, 2  # tests/tiny_models.py: 4 heads of hidden 32
IDS = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(1))
# the pico falcon is Falcon-RW's layout; these make the others
VARIANTS = {
    "rw_alibi": {},
    "rw_rotary": {"alibi": False},
    "new_decoder": {"new_decoder_architecture": True, "alibi": False, "parallel_attn": True, "bias": False},
}


def qkv_name(layer: int) -> str:
    return f"transformer.h.{layer}.self_attention.query_key_value.weight"


def generate(model, ids=IDS, steps: int = 6):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=steps, do_sample=False, use_cache=True, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_generate_at_g_equal_h_is_the_original(tiny_model, tmp_path, variant):
    """G = H: the same rows in gqakit's class, so the same tokens and logits at every cached
    step. Eager attention on both sides, so both run the same operations in the same order;
    the gqakit class views the rows as (G, H/G + 2, D) instead of (H, 3, D), which changes no
    value (exact)."""
    src = tiny_model("falcon", **VARIANTS[variant])
    out = convert_checkpoint(src, tmp_path / "g4", H, "mean", progress=False)
    from transformers import AutoModelForCausalLM

    a, b = (generate(AutoModelForCausalLM.from_pretrained(f, trust_remote_code=True, dtype=torch.float32,
                                                          attn_implementation="eager").eval()) for f in (src, out))
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert [layer.keys.shape[1] for layer in b.past_key_values.layers] == [H] * LAYERS


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_holds_g_heads(tiny_model, tmp_path, variant):
    out = convert_checkpoint(tiny_model("falcon", **VARIANTS[variant]), tmp_path / "g2", 2, "mean", progress=False)
    model = load(out)
    assert type(model).__name__ == "GqakitFalconForCausalLM"
    res = generate(model)
    assert res.sequences.shape == (2, 16)
    assert [layer.keys.shape[1] for layer in res.past_key_values.layers] == [2] * LAYERS
    assert [layer.values.shape[1] for layer in res.past_key_values.layers] == [2] * LAYERS
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_key_value_heads"] == cfg["num_kv_heads"] == 2


def test_mean_pooling_equals_a_reference_by_hand(tiny_model, tmp_path):
    """Falcon-RW rows are (H, 3, D); the output's are (G, H/G + 2, D): each group's query heads
    in their original order (ALiBi slopes follow positions), then the mean of the group's K
    heads, then of its V heads. The float64 mean is rounded to fp32 once by each side: at most
    one fp32 ulp apart if the two sums associate differently (rtol 2**-23)."""
    src = tiny_model("falcon")
    out = convert_checkpoint(src, tmp_path / "g2", 2, "mean", progress=False)
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    G, r = 2, H // 2
    for L in range(LAYERS):
        for suffix in ("weight", "bias"):
            name = qkv_name(L).replace("weight", suffix)
            rows = before[name].double().reshape(H, 3, D, -1)
            q, k, v = rows[:, 0], rows[:, 1], rows[:, 2]
            ref = torch.cat([q.reshape(G, r, D, -1), k.reshape(G, r, D, -1).mean(1, keepdim=True),
                             v.reshape(G, r, D, -1).mean(1, keepdim=True)], dim=1)
            ref = ref.reshape(after[name].shape).float()
            torch.testing.assert_close(after[name], ref, rtol=2.0 ** -23, atol=0)
        dense = qkv_name(L).replace("query_key_value", "dense")
        assert torch.equal(after[dense], before[dense])


def _tie_across_halves(folder: Path, out: Path) -> Path:
    """A copy whose K/V head j equals head j + H/2 (rows (H, 3, D)): equal heads that are not
    neighbours, which only a grouping that reorders heads pairs up."""
    shutil.copytree(folder, out)
    sd = load_file(folder / "model.safetensors")
    for L in range(LAYERS):
        for suffix in ("weight", "bias"):
            name = qkv_name(L).replace("weight", suffix)
            rows = sd[name].clone().reshape(H, 3, D, -1)
            rows[H // 2:, 1:] = rows[: H // 2, 1:]
            sd[name] = rows.reshape(sd[name].shape).contiguous()
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


# two layers' chains of reductions over hidden 32, MLP 128 and up to 12 positions, summed
PATH = LAYERS * (32 + 32 + 128 + 12 + 32)


def _slopes_left_in_place(model) -> None:
    for block in model.transformer.h:
        block.self_attention.head_order = None


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method", ["mean", "align"])
def test_alibi_slopes_follow_query_heads_a_grouping_moves_at_g_equal_h(tiny_model, tmp_path, monkeypatch,
                                                                      method, attn):
    """At G = H a grouping that reverses the heads keeps the function only if every query head
    takes its slope along: the recorded order is the reversal, each layer reads it, and the
    logits are the source's up to the rounding of the dense projection summing the heads in
    another order (eager: the bias added to the scores and the one inside the mask; SDPA: the
    mask's). The same weights with the slopes left in head-index order are far off."""
    from test_family_bloom import reversed_groups
    from tolerance import assert_close_by_rounding, rounding_tolerance

    from gqakit.convert.grouping import GROUPINGS

    monkeypatch.setitem(GROUPINGS, "reversed", reversed_groups)
    src = tiny_model("falcon")
    out = convert_checkpoint(src, tmp_path / "out", H, method, grouping="reversed", progress=False)
    order = json.loads((out / "config.json").read_text())["gqakit_query_head_order"]
    assert order == [list(reversed(range(H)))] * LAYERS
    from transformers import AutoModelForCausalLM

    model, ref = (AutoModelForCausalLM.from_pretrained(f, trust_remote_code=True, dtype=torch.float32,
                                                       attn_implementation=attn).eval() for f in (out, src))
    assert [b.self_attention.head_order for b in model.transformer.h] == order
    want = logits(ref)
    assert_close_by_rounding(logits(model), want, path_length=PATH)
    a, b = generate(model), generate(ref)  # cached steps: the bias spans the cache and the new token
    assert torch.equal(a.sequences, b.sequences)
    _slopes_left_in_place(model)
    tol = rounding_tolerance(torch.float32, PATH, float(want.abs().max()))
    assert (logits(model) - want).abs().max() > 10 * tol


def test_alibi_slopes_follow_query_heads_a_grouping_moves_at_g_below_h(tiny_model, tmp_path):
    """G = 2 on a model whose K/V head j equals head j + 2: similarity pairs heads 0 with 2 and
    1 with 3, which moves query heads; pooling equal heads is exact, so the converted model is
    the source up to rounding only if each query head kept its slope. align-refit's "auto"
    grouping (similarity on a model this small) moves them too: the calibration stage runs each
    stock block with the heads back at their source index, so its fit is the model that loads."""
    from tolerance import assert_close_by_rounding, rounding_tolerance

    alibi = _tie_across_halves(tiny_model("falcon"), tmp_path / "alibi")
    want = logits(load(alibi))
    out = convert_checkpoint(alibi, tmp_path / "sim", 2, "mean", grouping="similarity", progress=False)
    assert json.loads((out / "config.json").read_text())["gqakit_query_head_order"] == [[0, 2, 1, 3]] * LAYERS
    model = load(out)
    assert_close_by_rounding(logits(model), want, path_length=PATH)
    assert [layer.keys.shape[1] for layer in generate(model).past_key_values.layers] == [2] * LAYERS
    _slopes_left_in_place(model)
    assert (logits(model) - want).abs().max() > 10 * rounding_tolerance(torch.float32, PATH, float(want.abs().max()))
    out = convert_checkpoint(alibi, tmp_path / "auto", 2, "align-refit", calibration_tokens=128,
                             options={"seq_len": 32}, progress=False)
    assert json.loads((out / "gqakit_convert.json").read_text())["settings"]["grouping"] == "similarity"
    assert json.loads((out / "config.json").read_text())["gqakit_query_head_order"] == [[0, 2, 1, 3]] * LAYERS
    # the tolerance of test_architectures' align-refit exactness test (float64 fits, float32 streams)
    torch.testing.assert_close(logits(load(out)), want, rtol=0, atol=2e-4)


def test_rotary_falcon_records_no_query_head_order(tiny_model, tmp_path):
    """With rotary the heads' order carries no position: a grouping that moves them regroups
    exactly, config.json gains no query head order, and the modeling file reads none."""
    rotary = _tie_across_halves(tiny_model("falcon", alibi=False), tmp_path / "rotary")
    out = convert_checkpoint(rotary, tmp_path / "sim", 2, "mean", grouping="similarity", progress=False)
    assert "gqakit_query_head_order" not in json.loads((out / "config.json").read_text())
    model = load(out)
    assert all(b.self_attention.head_order is None for b in model.transformer.h)
    from tolerance import assert_close_by_rounding

    assert_close_by_rounding(logits(model), logits(load(rotary)), path_length=PATH)


def test_stock_new_decoder_gqa_regrouped_caches_g_heads(tiny_model, tmp_path):
    """A stock new-architecture checkpoint that is already GQA (2 KV heads) caches K/V
    broadcast to all 4 query heads; written again at G = 2 by gqakit it computes the same
    logits with 2 heads in the cache. Same operations in a different order (the stock class
    attends to broadcast K/V): tolerance from the reduction lengths."""
    src = tiny_model("falcon", **VARIANTS["new_decoder"], num_kv_heads=2)
    stock = load(src)
    with torch.no_grad():
        assert stock(IDS, use_cache=True).past_key_values.layers[0].keys.shape[1] == H
    out = convert_checkpoint(src, tmp_path / "g2", 2, "mean", progress=False)
    model = load(out)
    with torch.no_grad():
        assert model(IDS, use_cache=True).past_key_values.layers[0].keys.shape[1] == 2
    from tolerance import assert_close_by_rounding

    assert_close_by_rounding(logits(model), logits(stock), path_length=LAYERS * (32 + 32 + 128 + 10 + 32))


def test_multi_query_is_refused(tiny_model, tmp_path):
    src = tiny_model("falcon", multi_query=True)
    with pytest.raises(GqakitError, match="falcon with multi_query=True is not supported"):
        convert_checkpoint(src, tmp_path / "out", 1, progress=False)
    assert not (tmp_path / "out").exists()


def test_verbs_end_to_end(tiny_model, tmp_path, capsys):
    """convert, inspect, eval --data and a short uptrain run on the converted Falcon-RW."""
    from gqakit.uptrain import run_uptrain
    from test_uptrain import cfg

    src = tiny_model("falcon")
    out = tmp_path / "g2"
    code, _, err = run_cli(["convert", src, out, "--num-kv-heads", "2", "--method", "mean", "-q"], capsys)
    assert code == 0, err
    code, text, _ = run_cli(["inspect", out, "--json"], capsys)
    assert code == 0 and "falcon" in text and json.loads(text), text
    data = tmp_path / "d.txt"
    data.write_text(" ".join(chr(33 + i % 61) for i in range(400)))
    code, _, err = run_cli(["eval", out, "--data", data, "--context", "32", "--stride", "16",
                            "--out", tmp_path / "e.json", "-q"], capsys)
    assert code == 0, err
    ppl = json.loads((tmp_path / "e.json").read_text())["perplexity"]
    assert ppl["token_perplexity"] > 1 and ppl["tokens"] > 100
    final = run_uptrain(cfg(out, tmp_path / "run", tokens=16 * 2 * 2), quiet=True)
    from test_uptrain_lora import LORA

    lora = run_uptrain(cfg(out, tmp_path / "lora", tokens=16 * 2 * 2, lora=LORA), quiet=True)
    lora_sd, conv_sd = load(lora).state_dict(), load(out).state_dict()
    changed = {n for n in conv_sd if not torch.equal(lora_sd[n], conv_sd[n])}
    assert changed and all(any(t in n for t in TARGETS) for n in changed), changed  # the mean conversion's projections only
    trained = load(final)
    assert type(trained).__name__ == "GqakitFalconForCausalLM" and trained.config.num_key_value_heads == 2
    with torch.no_grad():
        assert trained(IDS, use_cache=True).past_key_values.layers[0].keys.shape[1] == 2


def test_speed_of_an_alibi_model_is_refused_before_loading(tiny_model, tmp_path, capsys):
    """transformers' Falcon cannot apply ALiBi over the static KV cache the speed grid times
    (its table entry's `position_bias.static_cache`): one line, exit 2, nothing written; a
    rotary Falcon is timed, and so is BLOOM, whose class spans its bias over the whole cache."""
    src, rotary, bloom = tiny_model("falcon"), tiny_model("falcon", alibi=False), tiny_model("bloom")
    capsys.readouterr()  # the pico models' save bars
    args = ["--speed", "--batch", "1", "--prompt-len", "8", "--new-tokens", "2", "--reps", "1", "--warmup", "1", "-q"]
    code, _, err = run_cli(["eval", src, *args, "--out", tmp_path / "s.json"], capsys)
    assert code == 2 and "uses ALiBi position biases" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "s.json").exists()
    for name, model in (("r", rotary), ("b", bloom)):
        code, _, err = run_cli(["eval", model, *args, "--out", tmp_path / f"{name}.json"], capsys)
        assert code == 0 and (tmp_path / f"{name}.json").is_file(), err
