"""`gqakit convert` and `gqakit inspect` on encoder-decoders (t5 in its 1.0 and 1.1 layouts,
mt5, bart and the BART-like pegasus, mbart, m2m100, marian), over every text-input family the
architecture table marks as one (the audio-input ones, whose encoder reads features instead of
token ids, in tests/test_family_<name>.py).

The references are written here, from the stock tensors and the stock classes, not through
gqakit: K/V heads pooled by hand, K/V heads made equal within groups by hand, and the stock
multi-head model's own logits and greedy generations.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM

from gqakit.cli import cli
from gqakit.cli import main as cli_main
from gqakit.convert import convert_checkpoint
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.methods import METHODS
from gqakit.core import arch
from gqakit.core.errors import GqakitError
from tiny_models import BART_LIKE, SEQ2SEQ_FAMILIES, SEQ2SEQ_FAMILY, TEXT_SEQ2SEQ_KINDS, build, build_seq2seq

H = 4  # heads of every attention of the pico encoder-decoders
PER_LAYER = [m for m, spec in METHODS.items() if not spec.needs_data]
# `random` draws fresh K/V heads (the paper's ablation), so it keeps no function: its own test
# checks what it writes
PRESERVING = [m for m in PER_LAYER if m != "random"]
CALIBRATED = [m for m, spec in METHODS.items() if spec.needs_data]
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
# K / V projections of each attention: (T5: SelfAttention / EncDecAttention .k/.v; BART: self_attn /
# encoder_attn .k_proj/.v_proj, weight and bias), and which stack they belong to
KV = re.compile(r"\.(SelfAttention|EncDecAttention|self_attn|encoder_attn)\.(k|v|k_proj|v_proj)\.(weight|bias)$")
ENCODER = re.compile(r"^(model\.)?encoder\.")
CROSS = re.compile(r"\.(EncDecAttention|encoder_attn)\.")


def test_every_encoder_decoder_family_is_covered():
    assert set(SEQ2SEQ_FAMILY.values()) == set(SEQ2SEQ_FAMILIES) == {"t5", "mt5", "bart", "pegasus", "mbart", "m2m100",
                                                                      "marian", "whisper"}
    assert all(arch.registry()[f].is_encoder_decoder for f in SEQ2SEQ_FAMILIES)


# --- helpers, written from the stock layouts ----------------------------------------------------

def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 40, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # one padded input: the cross-attention mask matters
    return {"input_ids": ids, "attention_mask": mask}


def decoder_ids() -> torch.Tensor:
    return torch.randint(4, 40, (2, 5), generator=torch.Generator().manual_seed(2))


def load(folder: Path) -> Any:
    return AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def forward(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs(), decoder_input_ids=decoder_ids()).logits


def generate(model: Any) -> Any:
    with torch.no_grad():
        return model.generate(**inputs(), **GEN, use_cache=True, return_dict_in_generate=True, output_scores=True)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def pool_by_hand(t: torch.Tensor, g: int) -> torch.Tensor:
    """Rows of H heads -> rows of g heads, each the mean of its group of H/g neighbouring heads."""
    return t.reshape(g, H // g, -1, *t.shape[1:]).mean(1).reshape(-1, *t.shape[1:])


def grouped_name(name: str, group_encoder: bool) -> bool:
    """Whether a conversion rewrites this K/V tensor (decoder always; encoder only when asked)."""
    return bool(KV.search(name)) and (group_encoder or not ENCODER.match(name))


def tie_heads(folder: Path, group: int) -> None:
    """Make K and V heads equal within each group of `group` neighbouring heads, in every
    attention of every stack (weights and biases), in place."""
    sd = weights(folder)
    for name, t in sd.items():
        if KV.search(name):
            heads = t.reshape(H // group, group, -1)
            sd[name] = heads[:, :1].expand_as(heads).reshape(t.shape).clone()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def convert(src: Path, out: Path, g: int, method: str = "mean", **kw: Any) -> Path:
    return convert_checkpoint(src, out, g, method, progress=False, **kw)


@pytest.fixture
def stock(tmp_path: Path):
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = build_seq2seq(kind, tmp_path / f"stock-{kind}")
        return made[kind]

    return make


# --- G = H: every method and grouping keeps the model ------------------------------------------

@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("method", PRESERVING)
@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_g_equals_h_is_exact(kind, method, grouping, stock, tmp_path, one_thread):
    src = stock(kind)
    out = convert(src, tmp_path / "out", H, method, grouping=grouping, group_encoder=True)
    ref, gqa = load(src), load(out)
    assert type(gqa).__name__ == arch.registry()[SEQ2SEQ_FAMILY[kind]].remote.model_class
    torch.testing.assert_close(forward(gqa), forward(ref), rtol=1e-5, atol=1e-5)
    want, got = generate(ref), generate(gqa)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", PRESERVING)
@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_equal_heads_convert_exactly(kind, method, tmp_path, one_thread):
    """K/V heads equal within each pair in all three attentions: G = H/2 (encoder grouped too)
    keeps the logits and the greedy generation, for every method."""
    src = build_seq2seq(kind, tmp_path / "src")
    tie_heads(src, 2)
    out = convert(src, tmp_path / "out", H // 2, method, group_encoder=True)
    ref, gqa = load(src), load(out)
    torch.testing.assert_close(forward(gqa), forward(ref), rtol=1e-5, atol=1e-5)
    assert torch.equal(generate(gqa).sequences, generate(ref).sequences)


# --- G < H: both caches hold G heads; mean is the paper's pooling ------------------------------

@pytest.mark.parametrize("g", [2, 1])
@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_grouped_caches_hold_g_heads(kind, g, stock, tmp_path, one_thread):
    src = stock(kind)
    out = convert(src, tmp_path / "out", g, "align")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["encoder_num_key_value_heads"]) == (g, H)
    model = load(out)
    d_head = getattr(model.config, "d_kv", None) or model.config.d_model // H
    result = generate(model)
    cache = result.past_key_values
    layers = len(cache.self_attention_cache.layers)
    assert layers == len(cache.cross_attention_cache.layers) == 2
    steps = result.sequences.shape[1] - 1
    for self_layer, cross_layer in zip(cache.self_attention_cache.layers, cache.cross_attention_cache.layers):
        for t in (self_layer.keys, self_layer.values):
            assert tuple(t.shape) == (2, g, steps, d_head)
        for t in (cross_layer.keys, cross_layer.values):
            assert tuple(t.shape) == (2, g, inputs()["input_ids"].shape[1], d_head)


@pytest.mark.parametrize("group_encoder", [False, True])
@pytest.mark.parametrize("g", [2, 1])
@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_mean_pools_neighbouring_heads(kind, g, group_encoder, stock, tmp_path):
    """mean = each group's K/V heads averaged (by hand here); every other tensor (the encoder's
    unless --group-encoder, the queries, the relative position bias) is kept bit for bit."""
    src = stock(kind)
    out = convert(src, tmp_path / "out", g, "mean", group_encoder=group_encoder)
    before, after = weights(src), weights(out)
    assert set(before) == set(after)
    pooled = [n for n in before if grouped_name(n, group_encoder)]
    # layers x attentions (self, cross, and the encoder's when grouped) x (k, v) x (weight, and bias for bart-likes)
    assert len(pooled) == 2 * (3 if group_encoder else 2) * 2 * (2 if kind in BART_LIKE else 1)
    assert any(CROSS.search(n) for n in pooled) and any(ENCODER.match(n) for n in pooled) == group_encoder
    for name, t in before.items():
        if name in pooled:
            torch.testing.assert_close(after[name], pool_by_hand(t, g), rtol=0, atol=1e-7)
        else:
            assert torch.equal(after[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["encoder_num_key_value_heads"] == (g if group_encoder else H)
    model = load(out)
    enc_k = [m for n, m in model.named_modules() if ENCODER.match(n) and n.endswith((".k", ".k_proj"))]
    assert enc_k and {m.out_features // (getattr(model.config, "d_kv", None) or model.config.d_model // H)
                      for m in enc_k} == {g if group_encoder else H}


@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_random_draws_fresh_heads_in_every_grouped_attention(kind, stock, tmp_path, one_thread):
    src = stock(kind)
    before = weights(src)
    runs = [weights(convert(src, tmp_path / f"rnd{i}", 2, "random", seed=seed, group_encoder=True))
            for i, seed in enumerate((1, 1, 2))]
    assert runs[0].keys() == before.keys()
    for name, t in before.items():
        if not KV.search(name):
            assert torch.equal(runs[0][name], t), name  # q, o and everything else untouched
        elif name.endswith("bias"):
            assert torch.equal(runs[0][name], torch.zeros(t.shape[0] // 2))
        else:
            assert runs[0][name].shape == (t.shape[0] // 2, t.shape[1])
            assert not torch.allclose(runs[0][name], pool_by_hand(t, 2), atol=1e-3)
            assert 0.5 < runs[0][name].std() / t.std() < 2
        assert torch.equal(runs[0][name], runs[1][name])  # the seed decides
    assert any(not torch.equal(runs[0][n], runs[2][n]) for n in before if KV.search(n))
    assert generate(load(tmp_path / "rnd0")).sequences.shape == (2, 1 + GEN["max_new_tokens"])


@pytest.mark.parametrize("group_encoder", [False, True])
@pytest.mark.parametrize("kind", ["t5_v1_1", "bart"])
def test_card_and_record_say_what_was_grouped(kind, group_encoder, stock, tmp_path):
    out = convert(stock(kind), tmp_path / "out", 2, group_encoder=group_encoder)
    want = ["decoder.self_attention", "decoder.cross_attention"] + (["encoder.self_attention"] if group_encoder
                                                                    else [])
    record = json.loads((out / "gqakit_convert.json").read_text())
    assert record["grouped"] == want
    assert (record["num_kv_heads_before"], record["num_kv_heads"]) == (H, 2)
    assert (record["encoder_num_kv_heads_before"], record["encoder_num_kv_heads"]) == (H, 2 if group_encoder else H)
    assert record["loads_with"] == "AutoModelForSeq2SeqLM.from_pretrained(OUT, trust_remote_code=True)"
    assert record["settings"].get("group_encoder", False) == group_encoder
    card = (out / "README.md").read_text()
    assert f"| grouped attentions | {', '.join(want)} |" in card
    family = SEQ2SEQ_FAMILY[kind]
    module = arch.registry()[family].remote.module or f"gqakit_modeling_{family}"
    assert (out / f"{module}.py").is_file()
    cfg = json.loads((out / "config.json").read_text())
    remote = arch.registry()[family].remote
    assert cfg["model_type"] == f"gqakit_{family}" and cfg["architectures"] == [remote.model_class]
    assert cfg["auto_map"] == {"AutoConfig": f"{module}.{remote.config_class}",
                               "AutoModelForSeq2SeqLM": f"{module}.{remote.model_class}"}
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / side).read_bytes() == (stock(kind) / side).read_bytes()


# --- refusals: one line, exit 2, nothing written -------------------------------------------------

def run_cli(args: list[str], capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli_main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_refusals_are_one_line(kind, stock, tmp_path, capsys):
    src = stock(kind)
    family = SEQ2SEQ_FAMILY[kind]
    for method in CALIBRATED:
        code, err = run_cli(["convert", src, tmp_path / "out", "-g", "2", "--method", method, "-q"], capsys)
        assert code == 2 and len(err) == 1 and "not implemented for encoder-decoders" in err[0] and family in err[0]
        with pytest.raises(GqakitError, match="calibrates through the model"):
            convert(src, tmp_path / "out", 2, method)
    code, err = run_cli(["convert", src, tmp_path / "out.gguf", "-g", "2", "-q"], capsys)
    assert code == 2 and len(err) == 1 and "GGUF input and output are for decoder-only models" in err[0]
    code, err = run_cli(["convert", src, tmp_path / "out", "-g", "3", "-q"], capsys)
    assert code == 2 and err == ["gqakit: error: --num-kv-heads 3 does not divide the decoder's 4 KV heads; "
                                 "valid: [1, 2, 4]"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"stock-{kind}"]  # nothing written, no temp folder


def test_gguf_output_is_refused_in_the_plan(stock, tmp_path):
    from gqakit.convert.plan import make_plan
    from gqakit.convert.settings import ConvertSettings
    from gqakit.convert.source import open_model

    src = stock("t5")
    opened = open_model(src, progress=False)
    with pytest.raises(GqakitError, match="GGUF input and output are for decoder-only models"):
        make_plan(opened, ConvertSettings(source=src, num_kv_heads=2), gguf_out=True)
    opened.source.close()


def test_group_encoder_needs_an_encoder(tmp_path, capsys):
    src = build("llama", tmp_path / "llama")
    code, err = run_cli(["convert", src, tmp_path / "out", "-g", "2", "--group-encoder", "-q"], capsys)
    assert code == 2 and err == ["gqakit: error: --group-encoder applies to encoder-decoder models; a llama "
                                 "model has no encoder"]
    assert not (tmp_path / "out").exists()


def test_group_encoder_help_says_why_the_paper_does_not():
    from gqakit.convert.cli import convert_cmd

    text = " ".join(CliRunner().invoke(convert_cmd, ["--help"]).output.split())
    assert "--group-encoder" in text and "runs once per input" in text and "in parallel" in text
    assert "not bound by memory bandwidth" in text


# --- inspect ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["t5_v1_1", "bart"])
def test_inspect_prices_both_caches(kind, stock, tmp_path, capsys):
    src = stock(kind)
    cfg = json.loads((src / "config.json").read_text())
    d_model, d_head = cfg["d_model"], cfg.get("d_kv") or cfg["d_model"] // H
    layers, bias = 2, kind == "bart"
    n_in, n_out, batch, elem = 300, 40, 3, 2
    res = CliRunner().invoke(cli, ["inspect", str(src), "--input-len", str(n_in), "--output-len", str(n_out),
                                   "--batch", str(batch), "--json", "--dtype-bytes", str(elem)])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["encoder_decoder"] is True and (info["input_len"], info["output_len"], info["batch"]) == \
        (n_in, n_out, batch)
    assert info["encoder"] == info["decoder"] == {"layers": layers, "query_heads": H, "kv_heads": H,
                                                  "head_dim": d_head}
    full = 2 * layers * H * d_head * elem * (n_in + n_out) * batch
    assert [r["kv_heads"] for r in info["options"]] == [4, 2, 1]
    for r in info["options"]:
        g = r["kv_heads"]
        per_token = 2 * layers * g * d_head * elem  # K and V, every decoder layer
        assert r["self_attention_bytes_per_output_token"] == r["cross_attention_bytes_per_input_token"] == per_token
        assert r["self_attention_cache_bytes"] == per_token * n_out * batch
        assert r["cross_attention_cache_bytes"] == per_token * n_in * batch
        assert r["kv_cache_bytes_saved"] == full - per_token * (n_in + n_out) * batch
        # K and V of the self- and cross-attention of each decoder layer lose (H - G) heads
        assert r["parameters_removed"] == 2 * layers * 2 * (H - g) * d_head * (d_model + bias)
    text = CliRunner().invoke(cli, ["inspect", str(src)]).output
    assert "input 512 tokens, output 128 tokens" in text and "cross cache" in text
    saved = cfg.get("dtype") or cfg.get("torch_dtype")  # by default, the cache in the saved dtype, named
    assert f"({saved}; self-attention per output token" in text and f"B/token ({saved})" in text
    code, err = run_cli(["inspect", src, "--context", "64"], capsys)
    assert code == 2 and len(err) == 1 and "--context applies to decoder-only models" in err[0]


def test_inspect_lengths_apply_to_encoder_decoders(tmp_path, capsys):
    src = build("llama", tmp_path / "llama")
    code, err = run_cli(["inspect", src, "--input-len", "64"], capsys)
    assert code == 2 and len(err) == 1 and "--input-len and --output-len apply to encoder-decoders" in err[0]


# --- the converted folder against its config (every verb checks a folder before it loads it) ----

@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_model_files_check_both_stacks(kind, stock, tmp_path):
    from gqakit.core.loading import check_weights

    src = stock(kind)
    check_weights(src)  # stock: T5's relative position bias sits in block 0 of each stack only
    out = convert(src, tmp_path / "out", 2, group_encoder=False)
    check_weights(out)
    cfg = json.loads((out / "config.json").read_text())
    for key, value, where in (("num_key_value_heads", 4, "decoder"), ("encoder_num_key_value_heads", 2, "encoder")):
        (out / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(GqakitError, match=rf"{key}={value}.* disagree with the weights: (model\.)?{where}\."):
            check_weights(out)
    (out / "config.json").write_text(json.dumps(cfg))
    sd = weights(out)
    # (sinusoidal positions may be a buffer that is not saved)
    bias = next((n for n in sd if "relative_attention_bias" in n or n.endswith("embed_positions.weight")), "")
    if "relative_attention_bias" in bias:  # one block of a stack with a tensor the others lack
        sd[bias.replace(".block.0.", ".block.1.")] = sd[bias].clone()
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(GqakitError, match="the layers hold different tensors"):
            check_weights(out)


def test_t5_config_without_decoder_depth(stock, tmp_path):
    """Early T5 configs (t5-small) state only num_layers: the decoder is as deep as the encoder."""
    import shutil

    src = shutil.copytree(stock("t5"), tmp_path / "old-t5")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["num_decoder_layers"]
    (src / "config.json").write_text(json.dumps({**cfg, "num_layers": 2, "n_positions": 512}))
    spec = arch.lookup(cfg)
    assert arch.shape_of(spec, cfg).num_layers == arch.encoder_shape_of(spec, cfg).num_layers == 2
    assert arch.shape_of(spec, {**cfg, "n_positions": 512}).max_positions == 512
    out = convert(src, tmp_path / "out", 2)
    assert forward(load(out)).shape == forward(load(src)).shape == (2, 5, 64)
    assert json.loads((out / "gqakit_convert.json").read_text())["num_layers"] == 2
