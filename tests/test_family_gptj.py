"""GPT-J: separate q/k/v without biases, rotate-every-two rotary on the first `rotary_dim` dims
of each head, GQA through gqakit_modeling_gptj.py. What the family-wide tests
(test_architectures.py, test_convert.py) do not already check: cached generation, the cache
at G < H, mean pooling against a reference written here, `align` on heads that differ by a
rotation of each interleaved rotary pair, and every verb end to end.

The checks take a `Family` (geometry, and the family's own tensors read by hand), so
test_family_codegen.py runs them on CodeGen (same rotary and blocks, a fused qkv_proj)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from gqakit.cli import main
from gqakit.convert import convert_checkpoint
from gqakit.core.errors import GqakitError
from gqakit.core.loading import load_causal_lm


@dataclass(frozen=True)
class Family:
    """A family's pico model (tests/tiny_models.py) as the checks below see it."""

    name: str
    H: int    # query heads
    D: int    # head size
    ROT: int  # rotated dims at the start of each head
    # (model, layer) -> q [H*D, in], k and v [KV*D, in]: the loaded model's weights, read by hand
    qkv: Callable[[Any, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # (model, fn): calls fn(q, k, v, o, layer) on each layer's [H*D, in] weights and [out, H*D] o,
    # and writes back what fn changed in place
    edit: Callable[[Any, Callable[..., None]], None]

IDS = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(3))
GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_logits=True)


def load(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def generate(model: Any, ids: torch.Tensor = IDS) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Greedy tokens, the logits of every step, and the cache (prefill, then one token a step)."""
    with torch.no_grad():
        out = model.generate(ids, **GREEDY)
    return out.sequences, torch.stack(out.logits), out.past_key_values


def check_generate_at_g_equal_h(fam: Family, src: Path, out: Path) -> None:
    """Converted to G = H, the cached generate gives the original's tokens and logits: every
    weight is copied unchanged and the GQA class runs the stock operations in the stock order
    (no K/V repeat at one query head per KV head), so they are bit for bit equal."""
    convert_checkpoint(src, out, fam.H, "mean", progress=False)
    tokens, logits, cache = generate(load(out))
    ref_tokens, ref_logits, _ = generate(load(src))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    assert [layer.keys.shape[1] for layer in cache.layers] == [fam.H, fam.H]


def check_cache_holds_g_heads(fam: Family, src: Path, tmp_path: Path) -> None:
    """At G < H (mean, random weights), generation runs and every cache layer, keys and values,
    holds G heads; the K/V projections hold G heads too."""
    for g in (2, 1):
        model = load(convert_checkpoint(src, tmp_path / f"g{g}", g, "mean", progress=False))
        tokens, _, cache = generate(model)
        assert tokens.shape == (2, IDS.shape[1] + 8)
        assert len(cache.layers) == 2
        for layer in cache.layers:
            assert layer.keys.shape[1] == layer.values.shape[1] == g
            assert layer.keys.shape[2] == IDS.shape[1] + 7  # prompt + every token but the last
        k, v = fam.qkv(model, 0)[1:]
        assert k.shape[0] == v.shape[0] == g * fam.D


def check_mean_is_the_mean(fam: Family, src: Path, out: Path) -> None:
    """mean pooling at G = 2: each pooled K/V head is the average of its group of H/G
    neighbouring heads (contiguous grouping), q and o unchanged; the reference pools the
    stock weights here, by hand. Tolerance: a two-term float32 average, written in float32."""
    ref, got = load(src), load(convert_checkpoint(src, out, 2, "mean", progress=False))
    for layer in range(2):
        q0, k0, v0 = fam.qkv(ref, layer)
        q1, k1, v1 = fam.qkv(got, layer)
        assert torch.equal(q1, q0)
        for orig, pooled in ((k0, k1), (v0, v1)):
            want = orig.view(2, fam.H // 2, fam.D, -1).mean(dim=1).reshape(2 * fam.D, -1)
            torch.testing.assert_close(pooled, want, rtol=0, atol=1e-6)


def rope_commuting_rotation(D: int, ROT: int, gen: torch.Generator) -> torch.Tensor:
    """A random orthogonal [D, D] that commutes with rotate-every-two RoPE on the first ROT
    dims: a 2x2 rotation of each interleaved pair (2i, 2i+1), any orthogonal on the rest."""
    r = torch.zeros(D, D)
    for i in range(0, ROT, 2):
        t = float(torch.rand((), generator=gen)) * 6.0 + 0.2
        c, s = torch.cos(torch.tensor(t)), torch.sin(torch.tensor(t))
        r[i:i + 2, i:i + 2] = torch.tensor([[c, -s], [s, c]])
    r[ROT:, ROT:] = torch.linalg.qr(torch.randn(D - ROT, D - ROT, generator=gen))[0]
    return r


def rotated_pairs(fam: Family, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, seed: int) -> None:
    """In place, on [H*D, in] q/k/v and [out, H*D] o: tie K and V within pairs of heads, then
    rotate each pair's second head (K and its query by a RoPE-commuting R, V by an orthogonal U,
    o's columns of that head by U^T). The model computes what the tied one does; the heads of a
    pair are no longer equal, so only an alignment that respects the interleaved pairs can
    pool them exactly."""
    H, D = fam.H, fam.D
    gen = torch.Generator().manual_seed(seed)
    qh, kh, vh, oh = q.view(H, D, -1), k.view(H, D, -1), v.view(H, D, -1), o.view(o.shape[0], H, D)
    for first in range(0, H, 2):
        kh[first + 1] = kh[first]
        vh[first + 1] = vh[first]
        r, u = rope_commuting_rotation(D, fam.ROT, gen), torch.linalg.qr(torch.randn(D, D, generator=gen))[0]
        kh[first + 1] = r @ kh[first + 1]
        qh[first + 1] = r @ qh[first + 1]
        vh[first + 1] = u @ vh[first + 1]
        oh[:, first + 1] = oh[:, first + 1] @ u.T


def check_align_on_rotated_heads(fam: Family, src: Path, tmp_path: Path) -> None:
    """`align` at G = H/2 on pairs of heads that differ by RoPE-commuting rotations keeps the
    logits, and `mean` does not (so the model really has unequal heads). Tolerance: the
    Procrustes fit recovers each rotation to float64 precision; the weights are then written
    in float32, so the logits move by float32 rounding of two layers of 8-term products."""
    model = load(src)
    tied = load(src)
    with torch.no_grad():
        fam.edit(model, lambda q, k, v, o, layer: rotated_pairs(fam, q, k, v, o, layer))
        fam.edit(tied, lambda q, k, v, o, layer: _tie(fam, k, v))
    ref = model(IDS).logits
    # the construction itself: rotating a tied head (and its query) changes no logit
    torch.testing.assert_close(ref, tied(IDS).logits, rtol=0, atol=1e-5)
    model.save_pretrained(tmp_path / "rotated")
    aligned = load(convert_checkpoint(tmp_path / "rotated", tmp_path / "align", fam.H // 2, "align", progress=False))
    torch.testing.assert_close(aligned(IDS).logits, ref, rtol=0, atol=2e-4)
    mean = load(convert_checkpoint(tmp_path / "rotated", tmp_path / "mean", fam.H // 2, "mean", progress=False))
    assert (mean(IDS).logits - ref).abs().max() > 1e-2
    same = load(convert_checkpoint(tmp_path / "rotated", tmp_path / "same", fam.H, "align", progress=False))
    torch.testing.assert_close(same(IDS).logits, ref, rtol=0, atol=0)  # groups of one head: copied as they are


def _tie(fam: Family, k: torch.Tensor, v: torch.Tensor) -> None:
    for t in (k.view(fam.H, fam.D, -1), v.view(fam.H, fam.D, -1)):
        t[1::2] = t[0::2]


def check_carries_its_modeling_file(fam: Family, src: Path, out: Path) -> None:
    """The output holds gqakit's modeling file and an auto_map to it; stock loading without
    trust_remote_code refuses the folder instead of loading it as MHA with missing weights."""
    convert_checkpoint(src, out, 2, "mean", progress=False)
    assert (out / f"gqakit_modeling_{fam.name}.py").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == f"gqakit_{fam.name}" and cfg["num_key_value_heads"] == 2
    assert cfg["auto_map"]["AutoModelForCausalLM"].startswith(f"gqakit_modeling_{fam.name}.")
    with pytest.raises(Exception, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
    assert type(load_causal_lm(out)).__name__ == cfg["architectures"][0]  # gqakit trusts its own file


def check_every_verb(fam: Family, src: Path, tmp_path: Path, capsys: Any) -> None:
    """convert (align), inspect, eval --data and a LoRA uptrain through the CLI and the API."""
    from gqakit.uptrain import run_uptrain

    def cli(args: list[str]) -> str:
        try:
            main(args)
        except SystemExit as e:
            assert e.code in (0, None), capsys.readouterr().err
        return capsys.readouterr().out

    out = tmp_path / "g2"
    cli(["convert", str(src), str(out), "-g", "2", "--method", "align", "-q"])
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    assert "2" in cli(["inspect", str(out)])
    text = " ".join(f"w{i % 13} x{i % 7}y z" for i in range(120))
    (tmp_path / "d.txt").write_text(text)
    cli(["eval", str(out), "--data", str(tmp_path / "d.txt"), "--context", "32", "--stride", "16",
         "--out", str(tmp_path / "r.json"), "-q"])
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["model"]["kv_heads"] == 2 and res["perplexity"]["token_perplexity"] > 1
    texts = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40)) for i in range(24)]
    run = tmp_path / "run"
    run_uptrain({
        "model": {"path": str(out)},
        "data": {"texts": texts, "eval_texts": texts[:4]},
        "train": {"tokens": 16 * 2 * 4, "seq_len": 16, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 1,
                  "precision": "fp32", "lora": {"r": 4, "alpha": 8}},
        "eval": {"every": 4},
        "output": {"dir": str(run), "save_every": 4},
        "logging": {"every": 1, "tensorboard": False},
    }, [])
    trained = load_causal_lm(run / "model")
    with torch.no_grad():
        cache = trained(IDS, use_cache=True).past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == [2, 2]
    before = load(out).state_dict()
    assert any(not torch.equal(t, before[n]) for n, t in trained.state_dict().items())  # the adapters, merged


# ----------------------------------------------------------------------------- GPT-J

def gptj_qkv(model: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = model.transformer.h[layer].attn
    return a.q_proj.weight, a.k_proj.weight, a.v_proj.weight


def gptj_edit(model: Any, fn: Callable[..., None]) -> None:
    for i, block in enumerate(model.transformer.h):
        a = block.attn
        fn(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.out_proj.weight, i)


GPTJ = Family("gptj", H=4, D=8, ROT=4, qkv=gptj_qkv, edit=gptj_edit)


def test_generate_at_g_equal_h_is_the_original(tiny_model, tmp_path):
    check_generate_at_g_equal_h(GPTJ, tiny_model("gptj"), tmp_path / "out")


def test_cache_holds_g_heads(tiny_model, tmp_path):
    check_cache_holds_g_heads(GPTJ, tiny_model("gptj"), tmp_path)


def test_carries_its_modeling_file(tiny_model, tmp_path):
    check_carries_its_modeling_file(GPTJ, tiny_model("gptj"), tmp_path / "out")


def test_mean_pools_each_group(tiny_model, tmp_path):
    check_mean_is_the_mean(GPTJ, tiny_model("gptj"), tmp_path / "out")


def test_align_undoes_rotations_of_interleaved_pairs(tiny_model, tmp_path, one_thread):
    check_align_on_rotated_heads(GPTJ, tiny_model("gptj"), tmp_path)


def test_rotary_dims_come_from_rotary_dim(tiny_model):
    from gqakit.core import arch

    cfg = json.loads((tiny_model("gptj") / "config.json").read_text())
    spec = arch.lookup(cfg)
    assert arch.shape_of(spec, cfg).rotary_dim == GPTJ.ROT
    assert arch.shape_of(spec, {**cfg, "rotary_dim": 8}).rotary_dim == 8
    for bad in (3, 10):
        with pytest.raises(GqakitError, match=f"rotary_dim={bad} must be even and at most the head size 8"):
            arch.shape_of(spec, {**cfg, "rotary_dim": bad})


def test_every_verb(tiny_model, tmp_path, capsys, one_thread):
    check_every_verb(GPTJ, tiny_model("gptj"), tmp_path, capsys)
