"""OLMo-2: q/k RMSNorms over the whole projection, whose weights belong to the heads.

What the family-wide tests (test_architectures.py, test_convert.py) do not cover: a cached
`generate`, the cache's head count, mean pooling against a reference written here from the
stock tensors, heads regrouped out of order (the norm weights must move with them), align's
K side behind a norm, and the verbs end to end (inspect, eval, uptrain).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gqakit.convert import convert_checkpoint
from test_cli_refusals_and_help import run_cli
from test_convert import load, logits

TARGETS = ("k_proj", "v_proj")  # what a mean conversion changed: LoRA adapts it
H, D, LAYERS = 8, 4, 2  # tests/tiny_models.py: 8 heads of hidden 32
IDS = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(1))


def generate(model, ids=IDS, steps: int = 6):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=steps, do_sample=False, use_cache=True, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)


def attn(layer: int, name: str) -> str:
    return f"model.layers.{layer}.self_attn.{name}"


def test_cached_generate_at_g_equal_h_is_the_original(tiny_model, tmp_path):
    """G = H: the same tensors, so the same tokens and the same logits at every cached step
    (exact: the conversion copies fp32 values through float64, which rounds back to them)."""
    src = tiny_model("olmo2")
    out = convert_checkpoint(src, tmp_path / "g8", H, "mean", progress=False)
    a, b = generate(load(src)), generate(load(out))
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(y, x, rtol=0, atol=0)


def test_cache_and_k_norm_hold_g_heads(tiny_model, tmp_path):
    out = convert_checkpoint(tiny_model("olmo2"), tmp_path / "g2", 2, "mean", progress=False)
    model = load(out)
    res = generate(model)
    assert res.sequences.shape == (2, 16)
    cache = res.past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == [2] * LAYERS
    assert [layer.values.shape[1] for layer in cache.layers] == [2] * LAYERS
    sd = load_file(out / "model.safetensors")
    assert sd[attn(0, "k_norm.weight")].shape == (2 * D,) and sd[attn(0, "q_norm.weight")].shape == (H * D,)


def test_mean_pooling_equals_a_reference_by_hand(tiny_model, tmp_path):
    """Each pooled K and V head, and each pooled k_norm weight, is its group's mean; q, q_norm
    and o are untouched. The float64 mean is rounded to fp32 once by each side: at most one
    fp32 ulp apart if the two sums associate differently (rtol 2**-23)."""
    src = tiny_model("olmo2")
    out = convert_checkpoint(src, tmp_path / "g2", 2, "mean", progress=False)
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    G, s = 2, H // 2
    for L in range(LAYERS):
        for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            t = before[attn(L, name)].double()
            ref = t.reshape(G, s, D, -1).mean(dim=1).reshape(G * D, *t.shape[1:]).float()
            torch.testing.assert_close(after[attn(L, name)], ref, rtol=2.0 ** -23, atol=0)
        for name in ("q_proj.weight", "q_norm.weight", "o_proj.weight"):
            assert torch.equal(after[attn(L, name)], before[attn(L, name)])


def _tie_across_halves(folder: Path, out: Path) -> Path:
    """A copy of `folder` whose K head j equals K head j + H/2 (V and the k_norm weights too):
    equal heads that are not neighbours, so only a grouping that reorders heads finds them."""
    import shutil

    shutil.copytree(folder, out)
    sd = load_file(folder / "model.safetensors")
    for L in range(LAYERS):
        for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            t = sd[attn(L, name)]
            heads = t.reshape(H, D, -1).clone()
            heads[H // 2:] = heads[: H // 2]
            sd[attn(L, name)] = heads.reshape(t.shape).contiguous()
    from safetensors.torch import save_file

    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("method", ["mean", "align"])
def test_regrouped_heads_carry_their_norm_weights(tiny_model, tmp_path, method):
    """Similarity grouping pairs head j with head j + H/2: the query heads move next to their
    K head, and q_norm's and k_norm's weights must move with them for the logits to stay. The
    RMS over the whole projection is unchanged by the reordering and by merging equal heads
    (each group's heads are equal, every group the same size). fp32, tolerance from ordering."""
    src = _tie_across_halves(tiny_model("olmo2"), tmp_path / "tied")
    out = convert_checkpoint(src, tmp_path / "g4", H // 2, method, grouping="similarity", progress=False)
    ref, got = logits(load(src)), logits(load(out))
    from tolerance import assert_close_by_rounding

    # two layers' chains of reductions over hidden 32, MLP 64 and 10 positions, summed
    assert_close_by_rounding(got, ref, path_length=LAYERS * (32 + 32 + 64 + 10 + 32))


def test_align_keeps_k_frames_behind_a_norm(tiny_model, tmp_path):
    """align's rotation of a K head does not commute with the norm weight that follows k_proj:
    with q/k norms, align rotates only V (and o), so its function-preserving step (before
    pooling) keeps the logits of random, unequal heads."""
    from gqakit.convert.grouping import contiguous_groups
    from gqakit.convert.layout import read_heads, write_heads
    from gqakit.convert.methods import align_transform
    from gqakit.convert.pooling import PoolContext
    from gqakit.core import arch

    src = tiny_model("olmo2")
    model = load(src)
    config = json.loads((src / "config.json").read_text())
    spec = arch.lookup(config)
    shape = arch.shape_of(spec, config)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    ref = logits(model)
    for L in range(LAYERS):
        heads = read_heads(spec, shape, sd, L, dtype=torch.float64)
        new = align_transform(heads, PoolContext(2, contiguous_groups(H, 2), "rotate_half", D, L))
        assert torch.equal(new.k, heads.k) and not torch.allclose(new.v, heads.v)
        sd.update(write_heads(spec, new, L, {n: torch.float32 for n in sd if n.startswith(attn(L, ""))}))
    model.load_state_dict(sd)
    from tolerance import assert_close_by_rounding

    assert_close_by_rounding(logits(model), ref, path_length=LAYERS * (32 + 32 + 64 + 10 + 32))


def test_verbs_end_to_end(tiny_model, tmp_path, capsys):
    """convert, inspect, eval --data and a short uptrain run on the converted model."""
    from gqakit.uptrain import run_uptrain
    from test_uptrain import cfg

    src = tiny_model("olmo2")
    out = tmp_path / "g2"
    assert run_cli(["convert", src, out, "--num-kv-heads", "2", "--method", "mean", "-q"], capsys)[0] == 0
    code, text, _ = run_cli(["inspect", out, "--json"], capsys)
    info = json.loads(text)
    assert code == 0 and "olmo2" in text and info, text
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
    assert trained.config.num_key_value_heads == 2 and trained.model.layers[0].self_attn.k_norm.weight.shape == (8,)
