"""Whisper: an encoder-decoder over log-mel audio features, converted by gqakit.

The decoder's self- and cross-attention are grouped, the audio encoder only with
`--group-encoder`. The references are written here from the stock tensors and the stock class
(`WhisperForConditionalGeneration`), not through gqakit: K/V heads pooled by hand, K/V heads
made equal within groups by hand, and the stock model's own logits and cached generations.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

from gqakit.cli import cli
from gqakit.cli import main as cli_main
from gqakit.convert import convert_checkpoint
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.methods import METHODS
from gqakit.convert.remote import gqakit_modeling_whisper, modeling_file
from gqakit.core import arch
from gqakit.core.errors import GqakitError
from gqakit.core.trust import is_shipped
from tiny_models import LAYERS, WHISPER_FRAMES, WHISPER_MELS, build_seq2seq
from tolerance import rounding_tolerance

H, D = 4, 8  # heads of every attention of the pico Whisper, and their size (d_model 32 / 4)
POSITIONS = WHISPER_FRAMES // 2  # encoder output positions: the conv front end has stride 2
PRESERVING = [m for m, spec in METHODS.items() if not spec.needs_data and m != "random"]
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
KV = re.compile(r"\.(self_attn|encoder_attn)\.(k_proj|v_proj)\.(weight|bias)$")
ENCODER = re.compile(r"^model\.encoder\.")
# Two evaluation orders of the pico model differ by rounding alone: the longest chain of
# reductions an output goes through is the conv front end (3 x (mels + d_model)), then per
# encoder layer q/k/v (d_model), scores and values (positions), out_proj (d_model) and the MLP
# (d_model + ffn), then per decoder layer the same twice (self and cross) plus the head (d_model).
PATH = 3 * (WHISPER_MELS + 32) + LAYERS * (32 + 2 * POSITIONS + 32 + 32 + 64) \
    + LAYERS * 2 * (32 + 2 * POSITIONS + 32) + LAYERS * (32 + 64) + 32
TOL = dict(rtol=0, atol=rounding_tolerance(torch.float32, PATH, 10.0))  # logits of magnitude below 10


def features(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, WHISPER_MELS, WHISPER_FRAMES, generator=torch.Generator().manual_seed(1))


def decoder_ids() -> torch.Tensor:
    return torch.randint(4, 40, (2, 5), generator=torch.Generator().manual_seed(2))


def load_stock(folder: Path, attn: str = "sdpa") -> Any:
    return AutoModelForSpeechSeq2Seq.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def load_gqa(folder: Path, attn: str = "sdpa") -> Any:
    model, info = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32,
                                                        attn_implementation=attn, output_loading_info=True)
    assert not any(info.values()), info  # a missing key would be silently random-initialised
    return model.eval()


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_features=features(), decoder_input_ids=decoder_ids()).logits


def generate(model: Any, **kw: Any) -> Any:
    with torch.no_grad():
        return model.generate(input_features=features(), **GEN, return_dict_in_generate=True, output_scores=True,
                              **kw)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def pool_by_hand(t: torch.Tensor, g: int) -> torch.Tensor:
    """Rows of H heads -> rows of g heads, each the mean of its group of H/g neighbouring heads."""
    return t.reshape(g, H // g, -1, *t.shape[1:]).mean(1).reshape(-1, *t.shape[1:])


def convert(src: Path, out: Path, g: int, method: str = "mean", **kw: Any) -> Path:
    return convert_checkpoint(src, out, g, method, progress=False, **kw)


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_seq2seq("whisper", tmp_path_factory.mktemp("whisper") / "stock")


def run_cli(args: list[Any], capsys: Any) -> tuple[int, list[str]]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli_main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err.strip().splitlines()


# --- the table entry and the modeling file -------------------------------------------------------

def test_modeling_file_is_self_contained_and_shipped() -> None:
    path = modeling_file("whisper")
    tree = ast.parse(path.read_text())
    imported = {n.name for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {m.split(".")[0] for m in imported} <= {"__future__", "typing", "torch", "transformers"}, imported
    assert is_shipped(path)


def test_kv_heads_are_the_decoders_own_key() -> None:
    """Stock WhisperConfig aliases num_key_value_heads to the encoder's heads; in gqakit's config
    it is the decoder's KV heads and leaves every head count as it was."""
    cls = gqakit_modeling_whisper.GqakitWhisperConfig
    cfg = cls(encoder_attention_heads=H, decoder_attention_heads=H, num_key_value_heads=2,
              encoder_num_key_value_heads=H)
    assert (cfg.encoder_attention_heads, cfg.decoder_attention_heads) == (H, H)
    assert (cfg.num_key_value_heads, cfg.encoder_num_key_value_heads) == (2, H)
    assert cls(encoder_attention_heads=H, decoder_attention_heads=H).num_key_value_heads == H
    for key in ("num_key_value_heads", "encoder_num_key_value_heads"):
        with pytest.raises(ValueError, match=rf"{key} \(3\) must be a positive divisor"):
            cls(encoder_attention_heads=H, decoder_attention_heads=H, **{key: 3})


def test_stock_source_loads_through_gqakit(stock: Path) -> None:
    from gqakit.core.loading import load_seq2seq_lm, seq2seq_auto_class

    assert seq2seq_auto_class(stock) == "AutoModelForSpeechSeq2Seq"
    model = load_seq2seq_lm(stock, progress=False)
    assert type(model).__name__ == "WhisperForConditionalGeneration"
    torch.testing.assert_close(logits(model), logits(load_stock(stock)), rtol=0, atol=0)


# --- G = H: every function-preserving method and grouping keeps the model ------------------------

@pytest.mark.parametrize("grouping", list(GROUPINGS))
@pytest.mark.parametrize("method", PRESERVING)
def test_g_equals_h_is_exact(method: str, grouping: str, stock: Path, tmp_path: Path, one_thread: Any) -> None:
    out = convert(stock, tmp_path / "out", H, method, grouping=grouping, group_encoder=True)
    ref, gqa = load_stock(stock), load_gqa(out)
    assert type(gqa).__name__ == arch.registry()["whisper"].remote.model_class
    torch.testing.assert_close(logits(gqa), logits(ref), **TOL)
    want, got = generate(ref), generate(gqa)  # Whisper's own generate, with its cache
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), **TOL)


@pytest.mark.parametrize("method", PRESERVING)
def test_equal_heads_convert_exactly(method: str, tmp_path: Path, one_thread: Any) -> None:
    """K/V heads equal within each pair in all three attentions: G = H/2 (encoder grouped too)
    keeps the logits and the cached generation, for every method."""
    src = build_seq2seq("whisper", tmp_path / "src")
    sd = weights(src)
    for name, t in sd.items():
        if KV.search(name):
            heads = t.reshape(H // 2, 2, -1)
            sd[name] = heads[:, :1].expand_as(heads).reshape(t.shape).clone()
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = convert(src, tmp_path / "out", H // 2, method, group_encoder=True)
    ref, gqa = load_stock(src), load_gqa(out)
    torch.testing.assert_close(logits(gqa), logits(ref), **TOL)
    assert torch.equal(generate(gqa).sequences, generate(ref).sequences)


# --- G < H: both caches hold G heads; mean is the paper's pooling --------------------------------

@pytest.mark.parametrize("g", [2, 1])
def test_grouped_caches_hold_g_heads(g: int, stock: Path, tmp_path: Path, one_thread: Any) -> None:
    out = convert(stock, tmp_path / "out", g, "align")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["encoder_num_key_value_heads"]) == (g, H)
    assert (cfg["encoder_attention_heads"], cfg["decoder_attention_heads"]) == (H, H)
    model = load_gqa(out)
    result = generate(model)
    cache = result.past_key_values
    assert len(cache.self_attention_cache.layers) == len(cache.cross_attention_cache.layers) == LAYERS
    steps = result.sequences.shape[1] - 1
    for self_layer, cross_layer in zip(cache.self_attention_cache.layers, cache.cross_attention_cache.layers):
        for t in (self_layer.keys, self_layer.values):
            assert tuple(t.shape) == (2, g, steps, D)
        for t in (cross_layer.keys, cross_layer.values):
            assert tuple(t.shape) == (2, g, POSITIONS, D)  # one per encoder output position
    # without a cache, and with transformers' static cache (sized from num_key_value_heads): the same tokens
    for kw in ({"use_cache": False}, {"cache_implementation": "static"}):
        assert torch.equal(generate(model, **kw).sequences, result.sequences), kw


@pytest.mark.parametrize("group_encoder", [False, True])
@pytest.mark.parametrize("g", [2, 1])
def test_mean_pools_neighbouring_heads(g: int, group_encoder: bool, stock: Path, tmp_path: Path) -> None:
    """mean = each group's K/V heads averaged (by hand here); every other tensor (the encoder's
    unless --group-encoder, the queries, the conv front end, the positions) is kept bit for bit."""
    out = convert(stock, tmp_path / "out", g, "mean", group_encoder=group_encoder)
    before, after = weights(stock), weights(out)
    assert set(before) == set(after)
    pooled = [n for n in before if KV.search(n) and (group_encoder or not ENCODER.match(n))]
    # layers x attentions (self, cross, and the encoder's when grouped) x (k weight, v weight, v bias)
    assert len(pooled) == LAYERS * (3 if group_encoder else 2) * 3
    assert not any(n.endswith("k_proj.bias") for n in before)  # Whisper's k_proj has no bias
    for name, t in before.items():
        if name in pooled:
            # a mean of H/g float32 values: at most one rounding per addition, far below 1e-7 here
            torch.testing.assert_close(after[name], pool_by_hand(t, g), rtol=0, atol=1e-7)
        else:
            assert torch.equal(after[name], t), name
    model = load_gqa(out)
    enc_k = [m for n, m in model.named_modules() if ENCODER.match(n) and n.endswith(".k_proj")]
    assert enc_k and {m.out_features // D for m in enc_k} == {g if group_encoder else H}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_grouped_equals_stock_with_repeated_heads(attn: str, stock: Path, tmp_path: Path, one_thread: Any) -> None:
    """The GQA class on G = 2 pooled heads computes what the stock class computes on the same
    heads repeated back to H (the reference the GQA paper's mean conversion defines)."""
    out = convert(stock, tmp_path / "out", 2, "mean", group_encoder=True)
    sd = weights(out)
    repeated = {n: t.reshape(2, -1, *t.shape[1:]).repeat_interleave(H // 2, dim=0).reshape(-1, *t.shape[1:])
                if KV.search(n) else t for n, t in sd.items()}
    ref_dir = tmp_path / "ref"
    load_stock(stock).save_pretrained(ref_dir)
    save_file(repeated, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref, gqa = load_stock(ref_dir, attn), load_gqa(out, attn)
    torch.testing.assert_close(logits(gqa), logits(ref), **TOL)
    assert torch.equal(generate(gqa).sequences, generate(ref).sequences)


# --- the command line ------------------------------------------------------------------------------

def test_cli_converts_and_inspects(stock: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["convert", str(stock), str(out), "-g", "2", "-q"])
    assert res.exit_code == 0, res.output
    record = json.loads((out / "gqakit_convert.json").read_text())
    assert record["family"] == "whisper" and record["grouped"] == ["decoder.self_attention",
                                                                   "decoder.cross_attention"]
    assert (record["encoder_num_kv_heads_before"], record["encoder_num_kv_heads"]) == (H, H)
    assert (out / "gqakit_modeling_whisper.py").is_file()
    res = CliRunner().invoke(cli, ["inspect", str(out), "--input-len", str(POSITIONS), "--output-len", "10",
                                   "--json", "--dtype-bytes", "4"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["decoder"] == {"layers": LAYERS, "query_heads": H, "kv_heads": 2, "head_dim": D}
    row = next(r for r in info["options"] if r["kv_heads"] == 2)
    # K and V of 2 heads of D floats, every decoder layer, per encoder output position
    assert row["cross_attention_bytes_per_input_token"] == 2 * LAYERS * 2 * D * 4


def test_refusals_are_one_line(stock: Path, tmp_path: Path, capsys: Any) -> None:
    for method in [m for m, spec in METHODS.items() if spec.needs_data]:
        code, err = run_cli(["convert", stock, tmp_path / "out", "-g", "2", "--method", method, "-q"], capsys)
        assert code == 2 and len(err) == 1 and "not implemented for encoder-decoders" in err[0]
        assert "whisper" in err[0]
        with pytest.raises(GqakitError, match="calibrates through the model"):
            convert(stock, tmp_path / "out", 2, method)
    code, err = run_cli(["convert", stock, tmp_path / "out.gguf", "-g", "2", "-q"], capsys)
    assert code == 2 and len(err) == 1 and "GGUF input and output are for decoder-only models" in err[0]
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp folder


# --- eval: the decoder's target perplexity on paired audio features and texts ----------------------

TARGETS = ["hello world", "a cat sat on the mat.", "ok"]


def feature_pairs(path: Path, n: int = len(TARGETS), **meta: str) -> Path:
    """A paired data file as the docs describe it: features [examples, bins, frames] and a JSON
    list of target texts in the metadata."""
    feats = torch.randn(n, WHISPER_MELS, WHISPER_FRAMES, generator=torch.Generator().manual_seed(3))
    save_file({"input": feats}, str(path), metadata=meta or {"target": json.dumps(TARGETS)})
    return path


def perplexity_by_hand(folder: Path, data: Path) -> tuple[float, int]:
    """exp(mean NLL) of every target token, each example alone, with the stock class and the
    folder's own tokenizer: written here, not through gqakit."""
    from safetensors.torch import load_file as load_tensors
    from transformers import AutoTokenizer

    model, tok = load_stock(folder), AutoTokenizer.from_pretrained(folder)
    feats = load_tensors(str(data))["input"]
    nll, count = 0.0, 0
    with torch.no_grad():
        for x, text in zip(feats, TARGETS):
            y = torch.tensor([tok(text_target=text)["input_ids"]])
            out = model(input_features=x[None], labels=y)
            nll += torch.nn.functional.cross_entropy(out.logits[0], y[0], reduction="sum").item()
            count += y.shape[1]
    return float(torch.tensor(nll / count).exp()), count


def test_eval_scores_targets_given_audio(stock: Path, tmp_path: Path) -> None:
    data = feature_pairs(tmp_path / "pairs.safetensors")
    out = convert(stock, tmp_path / "g4", H, "mean", group_encoder=True)  # the same function, in gqakit's class
    want, count = perplexity_by_hand(stock, data)
    for folder in (stock, out):
        res = CliRunner().invoke(cli, ["eval", str(folder), "--data", str(data), "--out",
                                       str(tmp_path / f"{folder.name}.json"), "-q"])
        assert res.exit_code == 0, res.output
        ppl = json.loads((tmp_path / f"{folder.name}.json").read_text())["perplexity"]
        assert (ppl["objective"], ppl["tokens"], ppl["examples"]) == ("paired", count, len(TARGETS))
        assert (ppl["context"], ppl["input_tokens"]) == (WHISPER_FRAMES, len(TARGETS) * WHISPER_FRAMES)
        assert ppl["fields"] == {"input": "input", "target": "target"}
        assert ppl["data"]["feature_frames"] == WHISPER_FRAMES and ppl["words"] > 0
        # one sum of a few dozen float32 NLLs, in another order: far below 1e-5 relative
        assert ppl["token_perplexity"] == pytest.approx(want, rel=1e-5)


def test_eval_refusals_are_one_line(stock: Path, tmp_path: Path, capsys: Any) -> None:
    text = tmp_path / "valid.txt"
    text.write_text("some text to score\n" * 20)
    pairs = feature_pairs(tmp_path / "pairs.safetensors")
    for args, want in (
        (["--data", text], "reads audio features: --data must be a .safetensors file"),
        (["--data", pairs, "--objective", "span_corruption"], "its perplexity is --objective paired"),
        (["--data", feature_pairs(tmp_path / "few.safetensors", target=json.dumps(TARGETS[:2]))],
         "2 targets for 3 examples"),
        (["--data", feature_pairs(tmp_path / "none.safetensors", other="[]")], "no 'target' metadata entry"),
        (["--data", pairs, "--input-field", "mel"], "no 'mel' tensor of input features"),
    ):
        code, err = run_cli(["eval", stock, *args, "--out", tmp_path / "r.json", "-q"], capsys)
        assert code == 2 and len(err) == 1 and want in err[0], err
    bart = build_seq2seq("bart", tmp_path / "bart")
    code, err = run_cli(["eval", bart, "--data", pairs, "--objective", "paired", "--out", tmp_path / "r.json", "-q"],
                        capsys)
    assert code == 2 and err == [f"gqakit: error: {pairs} holds audio features, and {bart} reads token ids: its "
                                 "paired data is a JSONL file of input/target objects"]
    assert not (tmp_path / "r.json").exists()


# --- decode speed: audio length x output length x batch, both caches in the bytes ------------------

def test_speed_grid_over_audio_prices_both_caches(stock: Path, tmp_path: Path, one_thread: Any) -> None:
    from gqakit.eval.speed import evaluate_speed
    from gqakit.eval.speed.settings import SpeedSettings

    g = 2
    model = load_gqa(convert(stock, tmp_path / "g2", g, "mean"))
    settings = SpeedSettings(batches=(1, 2), output_lens=(1, 3), new_tokens=3, reps=1, warmup=0)
    res = evaluate_speed(model, settings, device="cpu", dtype=torch.float32, progress=False)
    # no --input-len: the encoder's whole window, in feature frames
    assert res.settings["input_lens"] == [WHISPER_FRAMES] and "audio features" in res.settings["prompts"]
    assert [p.key for p in res.grid] == [(1, WHISPER_FRAMES, 1), (2, WHISPER_FRAMES, 1), (1, WHISPER_FRAMES, 3),
                                         (2, WHISPER_FRAMES, 3)]
    per_position = 2 * LAYERS * g * D * 4  # K and V of G heads, every decoder layer, float32
    assert res.kv_bytes_per_input_token == res.kv_bytes_per_token == per_position
    for p in res.grid:
        assert p.ok, p.reason
        cross = per_position * POSITIONS * p.batch  # the encoder's output positions: frames / 2
        own = per_position * (p.output_len + (3 + 1) / 2) * p.batch  # mean output position over the steps
        assert p.bytes_per_step["cross_attention_kv"] == cross and p.bytes_per_step["self_attention_kv"] == own
        assert p.bytes_per_step["total"] == res.weight_bytes_per_step + cross + own
        assert p.kv_cache_bytes == p.kv_cache_bytes_analytic == per_position * p.batch * (
            POSITIONS + p.output_len + 3)  # the caches the point allocated
    with pytest.raises(GqakitError, match=f"the encoder refuses an input of 16 feature frames"):
        evaluate_speed(model, SpeedSettings(input_lens=(16,), batches=(1,), new_tokens=1, reps=1, warmup=0),
                       device="cpu", dtype=torch.float32, progress=False)
    with pytest.raises(GqakitError, match=f"input length 48 exceeds the encoder's {WHISPER_FRAMES}"):
        evaluate_speed(model, SpeedSettings(input_lens=(48,)), device="cpu", dtype=torch.float32, progress=False)


def test_timed_steps_give_the_models_own_tokens(stock: Path, tmp_path: Path, one_thread: Any) -> None:
    """The bench's steps (both caches static, packed weights, folded attention) give the greedy
    tokens of the model's own generate."""
    from gqakit.eval.speed import Seq2SeqBench

    model = load_gqa(convert(stock, tmp_path / "g1", 1, "mean"))
    bench = Seq2SeqBench(model, device="cpu", dtype=torch.float32)
    got = bench.generate(features(), 1, 5)  # the prefix is the start token alone
    with torch.no_grad():
        want = model.generate(input_features=features(), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(got, want[:, -5:])


def test_feature_extractor_settings_travel_with_the_model(stock: Path, tmp_path: Path) -> None:
    """preprocessor_config.json (the log-mel feature extractor) and normalizer.json are side files:
    the converted folder carries them verbatim, so the model's processor loads from it."""
    import shutil

    from transformers import WhisperFeatureExtractor

    src = shutil.copytree(stock, tmp_path / "src")
    WhisperFeatureExtractor(feature_size=WHISPER_MELS).save_pretrained(src)
    (src / "normalizer.json").write_text('{"colour": "color"}')
    out = convert(src, tmp_path / "out", 2)
    for name in ("preprocessor_config.json", "normalizer.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert WhisperFeatureExtractor.from_pretrained(out).feature_size == WHISPER_MELS


# --- uptrain: paired audio features and target texts ----------------------------------------------

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]


def audio_pairs(path: Path, n: int, seed: int) -> Path:
    """Features that say which two words to write: word a's bins light up in the first half of
    the frames, word b's in the second, so the targets can be learnt from the audio."""
    g = torch.Generator().manual_seed(seed)
    feats = 0.1 * torch.randn(n, WHISPER_MELS, WHISPER_FRAMES, generator=g)
    texts = []
    for i in range(n):
        a, b = (int(v) for v in torch.randint(0, len(WORDS), (2,), generator=g))
        feats[i, a % WHISPER_MELS, : WHISPER_FRAMES // 2] += 2.0
        feats[i, b % WHISPER_MELS, WHISPER_FRAMES // 2:] += 2.0
        texts.append(f"{WORDS[a]} {WORDS[b]}")
    save_file({"input": feats}, str(path), metadata={"target": json.dumps(texts)})
    return path


def recipe(model: Path, out: Path, data: dict[str, Any], steps: int) -> dict[str, Any]:
    return {"model": {"path": str(model)}, "data": data,
            "train": {"tokens": steps * 4 * 24, "seq_len": 24, "micro_batch": 4, "lr": 1e-2, "warmup_steps": 1,
                      "precision": "fp32", "seed": 3},
            "output": {"dir": str(out)}, "logging": {"every": 1, "tensorboard": False}}


def test_uptrain_on_paired_audio_lowers_held_out_loss(stock: Path, tmp_path: Path, one_thread: Any) -> None:
    import yaml

    from gqakit.uptrain import run_uptrain

    g2 = convert(stock, tmp_path / "g2", 2, "mean")
    data = {"files": [str(audio_pairs(tmp_path / "train.safetensors", 64, 1))],
            "eval_file": str(audio_pairs(tmp_path / "eval.safetensors", 8, 2))}
    out = tmp_path / "run"
    final = run_uptrain(recipe(g2, out, data, 16), quiet=True)
    rows = [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.3, evals  # the targets are learnt from the features
    assert yaml.safe_load((out / "gqakit_uptrain.yaml").read_text())["data"]["objective"] == "paired"
    model = load_gqa(final)  # the trained GQA model loads as the converted one did, with G heads
    assert model.config.num_key_value_heads == 2 and generate(model).sequences.shape == (2, 1 + 6)


def test_uptrain_paired_audio_refusals_are_one_line(stock: Path, tmp_path: Path, capsys: Any) -> None:
    import yaml

    g2 = convert(stock, tmp_path / "g2", 2)
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text(json.dumps({"input": "a b", "target": "b a"}) + "\n")
    audio = audio_pairs(tmp_path / "train.safetensors", 8, 1)
    for data, want in (
        ({"files": [str(jsonl)]}, "data.files: paired data are features and target texts (.safetensors), not "
                                  "pairs.jsonl"),
        ({"files": [str(audio)], "objective": "span_corruption"}, f"data.objective: span_corruption; {g2} reads "
                                                                  "audio features"),
        ({"files": [str(audio)], "eval_file": str(jsonl)}, "data.eval_file: paired data are features and target "
                                                            "texts (.safetensors), not pairs.jsonl"),
    ):
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe(g2, tmp_path / "run", data, 4)))
        code, err = run_cli(["uptrain", path, "-q"], capsys)
        assert code == 2 and len(err) == 1 and want in err[0], err
    assert not (tmp_path / "run").exists()
