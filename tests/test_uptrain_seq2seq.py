"""Uptraining encoder-decoders on pico models (CPU): span corruption, paired rows, KL
distillation, exact resume, LoRA, and the one-line errors."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from safetensors.torch import load_file, save_file

from gqakit.core.errors import GqakitError
from gqakit.core.loading import load_seq2seq_lm
from gqakit.uptrain import run_uptrain
from tiny_models import build_seq2seq

TEXT = "the cat sat on the mat. "
TEXTS = [TEXT * (3 + i % 3) for i in range(40)]
EVAL = [TEXT * 4] * 4
HEADS = 4  # query heads of the pico encoder-decoders
WORDS = ["cat", "dog", "sun", "hat", "box", "red", "map", "pen"]


def student(kind: str, folder: Path, seed: int = 0) -> Path:
    """A pico encoder-decoder (stock classes, multi-head) as uptrain takes it: a model folder
    carrying convert's record."""
    build_seq2seq(kind, folder, seed=seed)
    (folder / "gqakit_convert.json").write_text(json.dumps({"family": kind, "settings": {"method": "mean"}}))
    return folder


def gqa_student(original: Path, folder: Path, g: int = 1) -> Path:
    """ORIGINAL (a pico T5) with its decoder's self- and cross-attention K/V heads mean-pooled to
    G, in gqakit's T5 modeling file: a GQA T5 as `gqakit convert -g G --method mean` writes it."""
    import gqakit.convert.remote as remote

    shutil.copytree(original, folder)
    sd = load_file(str(folder / "model.safetensors"))
    for key in [k for k in sd if re.match(r"decoder\..*(SelfAttention|EncDecAttention)\.[kv]\.weight$", k)]:
        w = sd[key]
        sd[key] = w.view(g, HEADS // g, -1, w.shape[1]).mean(1).flatten(0, 1).contiguous()
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update({"model_type": "gqakit_t5", "architectures": ["GqakitT5ForConditionalGeneration"],
                   "auto_map": {"AutoConfig": "gqakit_modeling_t5.GqakitT5Config",
                                "AutoModelForSeq2SeqLM": "gqakit_modeling_t5.GqakitT5ForConditionalGeneration"},
                   "num_key_value_heads": g, "encoder_num_key_value_heads": None})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(Path(remote.__file__).parent / "gqakit_modeling_t5.py", folder)
    return folder


def cfg(model: Path, out: Path, data: dict | None = None, steps: int = 12, **train) -> dict:
    return {
        "model": {"path": str(model)},
        "data": data or {"texts": TEXTS, "eval_texts": EVAL},
        "train": {"tokens": steps * 4 * 24, "seq_len": 24, "micro_batch": 4, "lr": 1e-2, "warmup_steps": 1,
                  "precision": "fp32", "seed": 3, **train},
        "output": {"dir": str(out)},
        "logging": {"every": 1, "tensorboard": False},
    }


def rows(out: Path) -> list[dict]:
    return [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]


def write_pairs(path: Path, n: int, offset: int = 0, drop: int | None = None) -> Path:
    """Rows {"input": "copy: w1 w2", "target": "w2 w1"}; row `drop` (1-based) lacks its target."""
    lines = []
    for i in range(n):
        a, b = WORDS[(i + offset) % 8], WORDS[(3 * i + offset + 1) % 8]
        row = {"input": f"swap: {a} {b}", "target": f"{b} {a}"}
        if drop == i + 1:
            del row["target"]
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def mha(tmp_path: Path) -> Path:
    """The original: a pico T5 1.1 (4 heads everywhere)."""
    return student("t5_v1_1", tmp_path / "mha")


@pytest.fixture
def t5(mha: Path, tmp_path: Path) -> Path:
    """The student: the original converted to G=1 (decoder self- and cross-attention)."""
    return gqa_student(mha, tmp_path / "g1")


def test_span_corruption_lowers_held_out_loss_and_exports(t5: Path, tmp_path: Path, one_thread):
    out = tmp_path / "run"
    final = run_uptrain(cfg(t5, out, steps=16), quiet=True)
    log = rows(out)
    evals = [r["eval_loss"] for r in log if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] - 0.3, evals  # held-out target loss, before and after
    saved = yaml.safe_load((out / "gqakit_uptrain.yaml").read_text())
    assert saved["data"]["objective"] == "span_corruption"  # "auto" on plain text, resolved
    model = load_seq2seq_lm(final)
    before = load_seq2seq_lm(t5).state_dict()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "held-out perplexity" in (final / "README.md").read_text()
    assert (final / "gqakit_convert.json").is_file() and (final / "gqakit_uptrain.yaml").is_file()
    # Still the GQA model: gqakit's modeling file travelled, and both caches hold G=1 heads.
    assert (final / "gqakit_modeling_t5.py").is_file() and type(model).__name__ == "GqakitT5ForConditionalGeneration"
    x = torch.tensor([[5, 6, 7, 1]])
    cache = model(input_ids=x, decoder_input_ids=x[:, :2], use_cache=True).past_key_values
    assert cache.self_attention_cache.layers[0].keys.shape[1] == cache.cross_attention_cache.layers[0].keys.shape[1] == 1
    assert model.generate(x, max_new_tokens=3).shape[0] == 1


def test_resume_after_an_interruption_is_bit_exact(t5: Path, tmp_path: Path, one_thread):
    out = tmp_path / "run"
    c = cfg(t5, out, steps=12)
    c["output"].update(save_every=4, keep_last=3)
    run_uptrain(c, quiet=True)
    want = rows(out)
    want_weights = load_seq2seq_lm(out / "model").state_dict()
    # What a run killed between the checkpoints of step 8 and 12 leaves on disk.
    shutil.rmtree(out / "checkpoints" / "step-12")
    shutil.rmtree(out / "model")
    run_uptrain(c, resume=True, quiet=True)
    def losses(log: list[dict]) -> list[tuple]:
        return [(r["step"], r["loss"], r["grad_norm"]) for r in log if "loss" in r]

    assert losses(rows(out)) == losses(want)  # to the bit
    assert [s for s, _, _ in losses(rows(out))] == list(range(1, 13))
    for k, v in load_seq2seq_lm(out / "model").state_dict().items():
        assert torch.equal(v, want_weights[k]), k


def test_paired_jsonl_for_a_model_without_sentinels(tmp_path: Path, one_thread):
    bart = student("bart", tmp_path / "bart")
    data = {"files": [str(write_pairs(tmp_path / "train.jsonl", 64))],
            "eval_file": str(write_pairs(tmp_path / "eval.jsonl", 8, offset=5))}
    out = tmp_path / "run"
    run_uptrain(cfg(bart, out, data, steps=16), quiet=True)
    evals = [r["eval_loss"] for r in rows(out) if "eval_loss" in r]
    assert evals[1] < evals[0] - 0.3, evals
    assert yaml.safe_load((out / "gqakit_uptrain.yaml").read_text())["data"]["objective"] == "paired"


def test_kl_distillation_from_the_original_model(mha: Path, t5: Path, tmp_path: Path, one_thread):
    c = cfg(t5, tmp_path / "run", steps=10)
    c["teacher"] = {"path": str(mha), "kl_weight": 1.0, "lm_weight": 0.0}  # pure distillation
    final = run_uptrain(c, quiet=True)
    kl = [r["kl"] for r in rows(tmp_path / "run") if "kl" in r]
    assert len(kl) == 10 and kl[0] > 1e-3 and kl[-1] < 0.3 * kl[0], kl  # the pooled heads learn the original's outputs
    assert "| teacher KL weight | 1.0 |" in (final / "README.md").read_text()
    # The student as its own teacher: nothing to distil.
    c = cfg(t5, tmp_path / "self", steps=1)
    c["teacher"] = {"path": str(t5), "kl_weight": 1.0}
    run_uptrain(c, quiet=True)
    assert rows(tmp_path / "self")[-2]["kl"] == pytest.approx(0.0, abs=1e-6)


def test_trainable_and_gradient_checkpointing(t5: Path, tmp_path: Path, one_thread):
    c = cfg(t5, tmp_path / "run", steps=3, trainable=[r"decoder\..*EncDecAttention"], gradient_checkpointing=True)
    final = run_uptrain(c, quiet=True)
    before, after = load_seq2seq_lm(t5).state_dict(), load_seq2seq_lm(final).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("EncDecAttention" in k and k.startswith("decoder.") for k in changed), changed


def test_lora_on_an_encoder_decoder_merges_into_a_plain_folder(t5: Path, tmp_path: Path, one_thread):
    targets = ["EncDecAttention.k", "EncDecAttention.v"]
    c = cfg(t5, tmp_path / "run", steps=4, lora={"r": 4, "targets": targets})
    final = run_uptrain(c, quiet=True)
    before, after = load_seq2seq_lm(t5).state_dict(), load_seq2seq_lm(final).state_dict()
    assert sorted(after) == sorted(before)  # the stock names, no adapter left
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("EncDecAttention.k.weight", "EncDecAttention.v.weight")) for k in changed)
    assert "LoRA" in (final / "README.md").read_text()


def test_lora_default_targets_are_the_attentions_the_conversion_grouped(mha: Path, tmp_path: Path, one_thread):
    from gqakit.convert import convert_checkpoint
    from gqakit.uptrain.lora import default_targets

    conv = convert_checkpoint(mha, tmp_path / "mean", 1, method="mean", progress=False)
    layers = json.loads((conv / "gqakit_convert.json").read_text())["num_layers"]
    grouped = [f"decoder.block.{L}.layer.{i}.{name}.{p}" for L in range(layers)
               for i, name in ((0, "SelfAttention"), (1, "EncDecAttention")) for p in "kv"]
    assert sorted(default_targets(conv)) == sorted(grouped)  # full names: never the encoder's SelfAttention
    both = convert_checkpoint(mha, tmp_path / "align", 1, method="align", group_encoder=True, progress=False)
    want = {f"{stack}.block.{L}.layer.{i}.{name}.{p}" for stack, sites in
            (("decoder", ((0, "SelfAttention"), (1, "EncDecAttention"))), ("encoder", ((0, "SelfAttention"),)))
            for L in range(layers) for i, name in sites for p in "qkvo"}
    assert set(default_targets(both)) == want

    final = run_uptrain(cfg(conv, tmp_path / "run", steps=4, lora={"r": 4}), quiet=True)
    before, after = load_seq2seq_lm(conv).state_dict(), load_seq2seq_lm(final).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {f"{t}.weight" for t in grouped}
    assert "decoder.block.*.layer.1.EncDecAttention.v (2 layers)" in (final / "README.md").read_text()


def test_one_line_errors(t5: Path, tmp_path: Path, tiny_model):
    def refused(c: dict, match: str) -> None:
        with pytest.raises(GqakitError, match=match) as e:
            run_uptrain(c, quiet=True)
        assert "\n" not in str(e.value)
        assert not Path(c["output"]["dir"]).exists()  # nothing written

    out = tmp_path / "run"
    bart = student("bart", tmp_path / "bart")
    refused(cfg(bart, out), r"span corruption needs sentinel tokens .*bart.* use paired input/target data")
    bad = write_pairs(tmp_path / "bad.jsonl", 6, drop=4)
    refused(cfg(t5, out, {"files": [str(bad)], "objective": "paired"}),
            rf"data.files: {bad} line 4: no 'target' field")
    good = write_pairs(tmp_path / "good.jsonl", 6)
    refused(cfg(t5, out, {"files": [str(good)], "eval_file": str(bad)}), "data.eval_file: .*bad.jsonl line 4")
    refused(cfg(t5, out, {"texts": TEXTS, "objective": "causal_lm"}), "causal_lm trains decoder-only models")
    llama = shutil.copytree(tiny_model("llama"), tmp_path / "llama")
    (llama / "gqakit_convert.json").write_text("{}")
    refused(cfg(llama, out, {"texts": TEXTS, "objective": "span_corruption"}),
            "span_corruption trains encoder-decoders")
    c = cfg(t5, out)
    c["teacher"] = {"path": str(t5), "hidden_weight": 1.0}
    refused(c, "teacher.hidden_weight: not for an encoder-decoder")
    refused(cfg(t5, out, lora={"r": 4}), r"train.lora.targets: .*gqakit_convert.json.*; give train.lora.targets")
    refused(cfg(t5, out, {"texts": TEXTS}, seq_len=512), "train.seq_len: 512 gives .* noise spans .* 16 sentinel")
    refused(cfg(t5, out, {"texts": ["the cat."]}), r"fewer than one block of \d+ tokens \(a span-corrupted input of "
            r"train.seq_len=24\)")



@pytest.mark.slow
def test_two_cpu_processes_match_one(t5: Path, tmp_path: Path):
    """Span corruption under 2 processes (torchrun + gloo) draws the spans of 1 process: the
    spans follow the global sample index, not the process."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    for name, accum in (("one", 2), ("two", 1)):
        c = cfg(t5, tmp_path / name, steps=6, micro_batch=2, grad_accum=accum)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(c))
    subprocess.run([sys.executable, "-m", "gqakit", "uptrain", "one.yaml", "-q"], check=True, env=env, cwd=tmp_path)
    subprocess.run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                    "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "gqakit", "uptrain", "two.yaml", "-q"],
                   check=True, env=env, cwd=tmp_path, timeout=600)
    a, b = rows(tmp_path / "one"), rows(tmp_path / "two")
    def losses(log: list[dict]) -> torch.Tensor:
        return torch.tensor([[r.get("loss", math.nan), r.get("eval_loss", math.nan)] for r in log if "tokens" in r])

    assert len(losses(a)) == 8  # held-out loss at step 0, 6 steps, held-out loss at the end
    torch.testing.assert_close(losses(b), losses(a), rtol=1e-5, atol=1e-6, equal_nan=True)
