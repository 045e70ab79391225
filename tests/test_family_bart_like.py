"""The BART-like encoder-decoders: Pegasus, mBART, M2M100 (NLLB-200) and Marian (OPUS-MT).

They share BART's attention (separate q/k/v/out projections with biases) and differ in
positions (sinusoidal for pegasus / m2m100 / marian, learned for mbart), layer norm placement,
embedding scale and the LM head's `final_logits_bias`. The family-wide tests
(test_convert_seq2seq.py, test_remote_seq2seq.py, test_architectures.py) run on their pico
models; here: each one end to end through the CLI (convert with mean and align, inspect, eval's
paired perplexity and decode speed, a short LoRA uptrain), a cached generate at G = H on inputs with
real padding tokens (M2M100 counts its positions past the padding), the caches at G < H, mean
pooling by hand, and the tensors that must pass through bit for bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM

from gqakit.cli import main
from gqakit.core import arch
from tiny_models import build_seq2seq

KINDS = ["pegasus", "mbart", "m2m100", "marian"]
H, PAD = 4, 1  # query heads of every stack; the pico models' <pad> id
KV = re.compile(r"\.(self_attn|encoder_attn)\.[kv]_proj\.(weight|bias)$")
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
PAIRS = [{"input": f"swap: {a} {b}", "target": f"{b} {a}."}
         for a, b in (("dog", "cat"), ("sun", "hat"), ("box", "red"), ("map", "pen"), ("cat", "sun"), ("hat", "map"))]

pytestmark = pytest.mark.usefixtures("one_thread")


def cli(args: list[Any], capsys: Any) -> tuple[int, str]:
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return code, capsys.readouterr().out


def load(folder: Path) -> Any:
    return AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def padded_inputs() -> dict[str, torch.Tensor]:
    """Two inputs, the second with <pad> ids (and a zero mask) after its end."""
    ids = torch.randint(4, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, 6:], mask[1, 6:] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask}


def generate(model: Any) -> Any:
    with torch.no_grad():
        return model.generate(**padded_inputs(), **GEN, use_cache=True, return_dict_in_generate=True,
                              output_scores=True)


def pool_by_hand(t: torch.Tensor, g: int) -> torch.Tensor:
    """Rows of H heads -> rows of G heads, each the mean of its H/G neighbouring heads."""
    return t.reshape(g, H // g, -1, *t.shape[1:]).mean(1).reshape(-1, *t.shape[1:])


@pytest.fixture(scope="module")
def stock(tmp_path_factory: Any) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bart_like")
    return {kind: build_seq2seq(kind, root / kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_table_entry_and_remote_class(kind: str, stock: dict[str, Path]) -> None:
    config = json.loads((stock[kind] / "config.json").read_text())
    spec = arch.lookup(config)
    assert spec.family == kind and spec.is_encoder_decoder and spec.decode is None
    assert spec.remote.module == "gqakit_modeling_bart"
    assert spec.cross_attention is not None and spec.encoder is not None


@pytest.mark.parametrize("kind", KINDS)
def test_cached_generate_at_g_equals_h_is_the_stock_model(kind: str, stock: dict[str, Path], tmp_path: Path,
                                                         capsys: Any) -> None:
    code, _ = cli(["convert", stock[kind], tmp_path / "out", "-g", H, "--force", "--group-encoder", "-q"], capsys)
    assert code == 0
    ref, gqa = load(stock[kind]), load(tmp_path / "out")
    assert type(gqa).__name__ == arch.registry()[kind].remote.model_class
    want, got = generate(ref), generate(gqa)
    assert torch.equal(got.sequences, want.sequences)
    # float32, a 2-layer pico model: the same operations on the same weights, so equal to rounding;
    # 1e-5 leaves room for sdpa picking another kernel for the GQA call
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("g", [2, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_mean_pools_by_hand_and_both_caches_hold_g_heads(kind: str, g: int, stock: dict[str, Path],
                                                         tmp_path: Path, capsys: Any) -> None:
    code, _ = cli(["convert", stock[kind], tmp_path / "out", "-g", g, "--method", "mean", "-q"], capsys)
    assert code == 0
    before, after = load_file(str(stock[kind] / "model.safetensors")), load_file(str(tmp_path / "out" /
                                                                                     "model.safetensors"))
    assert set(before) == set(after)
    pooled = [n for n in before if KV.search(n) and ".decoder." in n]
    assert len(pooled) == 2 * 2 * 2 * 2  # layers x (self, cross) x (k, v) x (weight, bias)
    for name, t in before.items():
        if name in pooled:
            torch.testing.assert_close(after[name], pool_by_hand(t, g), rtol=0, atol=1e-7)  # a 2- or 4-term mean
        else:  # queries, the encoder, positions, norms, final_logits_bias: bit for bit
            assert torch.equal(after[name], t), name
    assert ("final_logits_bias" in before) == (kind != "m2m100")  # M2M100's LM head has no bias
    model = load(tmp_path / "out")
    out = generate(model)
    cache, d_head = out.past_key_values, model.config.d_model // H
    steps = out.sequences.shape[1] - 1
    assert len(cache.self_attention_cache.layers) == len(cache.cross_attention_cache.layers) == 2
    for self_layer, cross_layer in zip(cache.self_attention_cache.layers, cache.cross_attention_cache.layers):
        for t in (self_layer.keys, self_layer.values):
            assert tuple(t.shape) == (2, g, steps, d_head)
        for t in (cross_layer.keys, cross_layer.values):
            assert tuple(t.shape) == (2, g, 9, d_head)


@pytest.mark.parametrize("kind", KINDS)
def test_end_to_end_convert_inspect_eval_uptrain(kind: str, stock: dict[str, Path], tmp_path: Path,
                                                 capsys: Any) -> None:
    from gqakit.uptrain import run_uptrain

    src, out = stock[kind], tmp_path / "g2"
    assert cli(["convert", src, out, "-g", 2, "--method", "align", "-q"], capsys)[0] == 0
    record = json.loads((out / "gqakit_convert.json").read_text())
    assert record["family"] == kind and record["grouped"] == ["decoder.self_attention", "decoder.cross_attention"]
    assert (out / "gqakit_modeling_bart.py").is_file()

    code, text = cli(["inspect", out, "--json"], capsys)
    info = json.loads(text)
    assert code == 0 and info["decoder"]["kv_heads"] == 2 and info["encoder"]["kv_heads"] == H

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    results = tmp_path / "r.json"
    code, _ = cli(["eval", out, "--data", pairs, "--objective", "paired", "--context", 24,
                   "--speed", "--batch", 1, "--input-len", 8, "--output-len", 2, "--new-tokens", 2,
                   "--reps", 1, "--warmup", 0, "--device", "cpu", "--out", results, "-q"], capsys)
    assert code == 0
    res = json.loads(results.read_text())
    assert res["model"]["kv_heads"] == 2 and res["model"]["encoder"]["kv_heads"] == H
    assert res["perplexity"]["objective"] == "paired" and res["perplexity"]["examples"] == len(PAIRS)
    assert 1 < res["perplexity"]["token_perplexity"] < float("inf")
    # one grid point, timed on the model's own decode step (no lean step for this layout); its
    # cross-attention cache per input token: K and V x 2 layers x G=2 heads x head_dim 8 x 4 bytes
    speed = res["speed"]
    assert len(speed["grid"]) == 1 and speed["kv_bytes_per_input_token"] == 2 * 2 * 2 * 8 * 4

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"input": f"swap: {w} {w}", "target": f"{w} {w}."}) + "\n"
                                for w in ("pen", "box")))
    run = tmp_path / "run"
    final = run_uptrain({
        "model": {"path": str(out)},
        "data": {"files": [str(pairs)], "eval_file": str(held_out)},
        "train": {"tokens": 4 * 2 * 16, "seq_len": 16, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 1,
                  "precision": "fp32", "seed": 3, "lora": {"r": 4}},
        "output": {"dir": str(run)},
        "logging": {"every": 1, "tensorboard": False},
    }, quiet=True)
    trained = load(final)
    assert type(trained).__name__ == arch.registry()[kind].remote.model_class
    assert trained.config.num_key_value_heads == 2
    assert (final / "gqakit_modeling_bart.py").read_bytes() == (out / "gqakit_modeling_bart.py").read_bytes()
    # LoRA's default targets come from the record: the decoder's self- and cross-attention
    # projections that `align` changed, merged at export; nothing else moves
    before = load(out).state_dict()
    changed = {k for k, v in trained.state_dict().items() if not torch.equal(before[k], v)}
    site = re.compile(r"model\.decoder\.layers\.\d\.(self_attn|encoder_attn)\.(q|k|v|out)_proj\.weight")
    assert changed and all(site.fullmatch(k) for k in changed), changed
    assert any(".encoder_attn.k_proj." in k for k in changed) and any(".self_attn.v_proj." in k for k in changed)
