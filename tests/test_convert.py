"""`gqakit convert`: exactness on every architecture layout, cache size, loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gqakit.convert import convert_checkpoint
from tiny_models import FAMILIES

NATIVE = {"llama", "mistral", "qwen2", "gemma", "phi"}
IDS = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def load(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def num_heads(model) -> int:
    c = model.config
    return getattr(c, "num_attention_heads", None) or c.n_head


def equalize_kv(model, family: str, group: int) -> None:
    """Make K and V heads identical within each group of `group` neighbouring heads.

    Written per family straight from the stock module layouts (not through gqakit), so
    the exactness tests check gqakit's layout handling instead of trusting it.
    """
    H = num_heads(model)
    sd = model.state_dict()

    def tie(t: torch.Tensor, dim: int, D: int) -> None:
        """Along `dim` (H heads of D rows, or H heads), copy each group's first head to the others."""
        v = t.movedim(dim, 0)
        heads = v.reshape(H // group, group, -1)
        t.copy_(heads[:, :1].expand_as(heads).reshape(v.shape).movedim(0, dim))

    with torch.no_grad():
        for name, t in sd.items():
            if family == "gpt2" and name.endswith("attn.c_attn.weight"):
                D = t.shape[1] // 3 // H
                for part in (1, 2):  # k, v columns
                    block = t[:, part * H * D:(part + 1) * H * D]
                    tie(block, 1, D)
            elif family == "gpt2" and name.endswith("attn.c_attn.bias"):
                D = t.shape[0] // 3 // H
                for part in (1, 2):
                    tie(t[part * H * D:(part + 1) * H * D], 0, D)
            elif family == "phi3" and name.endswith("self_attn.qkv_proj.weight"):
                D = t.shape[0] // 3 // H  # rows [q heads | k heads | v heads] (MHA: H each)
                for part in (1, 2):
                    tie(t[part * H * D:(part + 1) * H * D], 0, D)
            elif family == "codegen" and name.endswith("qkv_proj.weight"):
                D = t.shape[0] // 3 // H
                v = t.view(4, 3, H // 4 * D, *t.shape[1:])  # 4 blocks of [q | v | k], H/4 heads each
                for part in (1, 2):
                    tie(v[:, part], 0, D)
            elif family in ("gpt_neox", "falcon") and "query_key_value" in name:  # rows (H, 3, D)
                D = t.shape[0] // 3 // H
                v = t.view(H, 3, D, *t.shape[1:])
                for part in (1, 2):
                    tie(v[:, part], 0, D)
            elif family == "bloom" and "query_key_value" in name:  # rows (H, 3, D), as GPT-NeoX's
                D = t.shape[0] // 3 // H
                v = t.view(H, 3, D, *t.shape[1:])
                for part in (1, 2):
                    tie(v[:, part], 0, D)
            elif family == "mpt" and name.endswith("attn.Wqkv.weight"):  # rows [q | k | v] (MHA: H each)
                D = t.shape[0] // 3 // H
                for part in (1, 2):
                    tie(t[part * H * D:(part + 1) * H * D], 0, D)
            elif family == "olmo2" and name.endswith("self_attn.k_norm.weight"):
                tie(t, 0, t.shape[0] // H)  # an RMSNorm over all K heads: one weight per head and dim
            elif any(name.endswith(f"attn.{p}_proj.{w}") for p in "kv" for w in ("weight", "bias")):
                D = t.shape[0] // (model.config.num_key_value_heads if hasattr(model.config, "num_key_value_heads") else H)
                tie(t, 0, D)


def cache_heads(model, ids=IDS) -> list[int]:
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return [layer.keys.shape[1] for layer in out.past_key_values.layers]


@pytest.mark.parametrize("family", FAMILIES)
def test_g_equal_h_reproduces_logits(tiny_model, tmp_path, family):
    src = tiny_model(family)
    ref = logits(load(src))
    H = num_heads(load(src))
    out = convert_checkpoint(src, tmp_path / "out", H, progress=False)
    torch.testing.assert_close(logits(load(out)), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("g", [2, 1])
def test_equal_heads_convert_exactly(tiny_model, tmp_path, family, g):
    src = tiny_model(family)
    model = load(src)
    H = num_heads(model)
    equalize_kv(model, family, H // g)
    model.save_pretrained(tmp_path / "expanded")
    ref = logits(model)
    out = convert_checkpoint(tmp_path / "expanded", tmp_path / "out", g, progress=False)
    gqa = load(out)
    torch.testing.assert_close(logits(gqa), ref, rtol=1e-5, atol=1e-5)
    assert cache_heads(gqa) == [g] * model.config.num_hidden_layers
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_key_value_heads"] == g
    greedy = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(gqa.generate(IDS[:1], **greedy), model.generate(IDS[:1], **greedy))


@pytest.mark.parametrize("family", sorted(NATIVE))
def test_native_families_load_with_stock_class_without_remote_code(tiny_model, tmp_path, family):
    out = convert_checkpoint(tiny_model(family), tmp_path / "out", 2, progress=False)
    model = AutoModelForCausalLM.from_pretrained(out)  # no trust_remote_code
    assert cache_heads(model) == [2] * model.config.num_hidden_layers
    assert not list(out.glob("*.py"))


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "opt"])
def test_remote_families_carry_their_modeling_file(tiny_model, tmp_path, family):
    out = convert_checkpoint(tiny_model(family), tmp_path / "out", 2, progress=False)
    assert (out / f"gqakit_modeling_{family}.py").is_file()
    with pytest.raises(Exception):
        AutoModelForCausalLM.from_pretrained(out)  # without trust_remote_code it must not load silently
    assert cache_heads(load(out)) == [2, 2]


def test_regrouping_an_already_gqa_model(tiny_model, tmp_path):
    src = tiny_model("llama", num_key_value_heads=4)
    out = convert_checkpoint(src, tmp_path / "g2", 2, "mean", progress=False)
    out1 = convert_checkpoint(out, tmp_path / "g1", 1, "mean", progress=False)
    assert cache_heads(load(out1)) == [1, 1]
    k = load(src).model.layers[0].self_attn.k_proj.weight.view(4, 4, 32)
    k1 = load(out1).model.layers[0].self_attn.k_proj.weight
    torch.testing.assert_close(k1, k.mean(0), rtol=1e-6, atol=1e-6)  # mean of means of equal groups


def test_mean_first_random_pool_as_the_paper_says(tiny_model, tmp_path):
    src = tiny_model("qwen2")  # q/k/v biases
    m = load(src).model.layers[1].self_attn
    k, kb = m.k_proj.weight.view(4, 2, 4, 32), m.k_proj.bias.view(4, 2, 4)  # (groups, r, D, in)
    mean = load(convert_checkpoint(src, tmp_path / "mean", 4, "mean", progress=False)).model.layers[1].self_attn
    torch.testing.assert_close(mean.k_proj.weight, k.mean(1).reshape(16, 32))
    torch.testing.assert_close(mean.k_proj.bias, kb.mean(1).reshape(16))
    first = load(convert_checkpoint(src, tmp_path / "first", 4, "first", progress=False)).model.layers[1].self_attn
    torch.testing.assert_close(first.v_proj.weight, m.v_proj.weight.view(4, 2, 4, 32)[:, 0].reshape(16, 32))
    rnd = load(convert_checkpoint(src, tmp_path / "rnd", 4, "random", seed=1, progress=False)).model.layers[1].self_attn
    assert not torch.allclose(rnd.k_proj.weight, mean.k_proj.weight)
    assert 0.5 < rnd.k_proj.weight.std() / m.k_proj.weight.std() < 2
    # q and o are untouched by every method
    torch.testing.assert_close(first.q_proj.weight, m.q_proj.weight)
    torch.testing.assert_close(rnd.o_proj.weight, m.o_proj.weight)


def test_gemma_head_dim_differs_from_hidden_over_heads(tiny_model, tmp_path):
    out = convert_checkpoint(tiny_model("gemma"), tmp_path / "out", 1, progress=False)
    attn = load(out).model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (16, 32) and attn.q_proj.weight.shape == (64, 32)


def test_sharded_output_and_sharded_input(tiny_model, tmp_path):
    src = tiny_model("llama")
    model = load(src)
    model.save_pretrained(tmp_path / "sharded-src", max_shard_size="20KB")
    assert (tmp_path / "sharded-src" / "model.safetensors.index.json").is_file()
    out = convert_checkpoint(tmp_path / "sharded-src", tmp_path / "out", 8, max_shard_size="10KB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    torch.testing.assert_close(logits(load(out)), logits(model))


def test_bin_input_and_bf16_output(tiny_model, tmp_path):
    src = tiny_model("llama")
    model = load(src)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bin_dir / f).write_bytes((src / f).read_bytes())
    out = convert_checkpoint(bin_dir, tmp_path / "out", 8, dtype="bfloat16", progress=False)
    gqa = AutoModelForCausalLM.from_pretrained(out)
    assert gqa.model.layers[0].self_attn.k_proj.weight.dtype == torch.bfloat16
    torch.testing.assert_close(gqa.float()(IDS).logits, logits(model), rtol=0.05, atol=0.05)


def test_output_folder_is_self_contained(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    src = tiny_model("llama")
    out = convert_checkpoint(src, tmp_path / "out", 2, "mean", progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "gqakit_convert.json", "tokenizer.json"} <= names
    record = json.loads((out / "gqakit_convert.json").read_text())
    assert record["settings"]["method"] == "mean" and record["num_kv_heads"] == 2
    assert record["kv_cache_bytes_per_token_before"] == 4 * record["kv_cache_bytes_per_token_after"]
    card = (out / "README.md").read_text()
    assert "8 → 2" in card and f"| source | `{src.name}` |" in card and "mean" in card
    assert str(src.resolve()) not in card  # a card is for sharing: no local path (the record keeps it)
    assert record["settings"]["source"] == str(src.resolve())
    assert AutoTokenizer.from_pretrained(out)("a b").input_ids == AutoTokenizer.from_pretrained(src)("a b").input_ids
    assert not [p for p in tmp_path.iterdir() if ".gqakit-tmp-" in p.name]


@pytest.mark.assets
def test_stories260k_round_trip_and_real_conversions(shared, tmp_path):
    """Expand the real GQA model to MHA, convert back to 4: same logits; 2 and 1 load and generate."""
    src = shared / "models" / "stories260K"
    orig = load(src)
    mha = load(src)
    H, KV, D = 8, 4, 8
    with torch.no_grad():
        for layer in mha.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                w = proj.weight.view(KV, D, -1).repeat_interleave(H // KV, dim=0).reshape(H * D, -1)
                proj.weight = torch.nn.Parameter(w.contiguous())
    mha.config.num_key_value_heads = H
    for layer in mha.model.layers:
        layer.self_attn.num_key_value_groups = 1
    mha.save_pretrained(tmp_path / "mha")
    ids = torch.cat([torch.ones(1, 1, dtype=torch.long), torch.randint(3, 512, (1, 63))], dim=1)
    ref = logits(orig, ids)
    torch.testing.assert_close(logits(load(tmp_path / "mha"), ids), ref, rtol=1e-5, atol=1e-5)
    back = load(convert_checkpoint(tmp_path / "mha", tmp_path / "g4", 4, progress=False))
    torch.testing.assert_close(logits(back, ids), ref, rtol=1e-5, atol=1e-5)
    for g in (2, 1):
        m = load(convert_checkpoint(src, tmp_path / f"g{g}", g, progress=False))
        assert cache_heads(m, ids) == [g] * 5
        text = m.generate(torch.ones(1, 1, dtype=torch.long), max_new_tokens=8, do_sample=False)
        assert text.shape == (1, 9)
