"""LoRA uptraining (train.lora, through peft) on pico models: only adapters train, the export
is a plain model with the adapters merged, the defaults follow the conversion, errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from gqakit.core.errors import GqakitError
from gqakit.core.loading import load_causal_lm
from gqakit.uptrain import run_uptrain
from gqakit.uptrain.config import load_config
from gqakit.uptrain.lora import apply_lora, default_targets, merged_state_dict

TEXTS = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40 + i % 9)) for i in range(60)]
EVAL = [" ".join(chr(33 + (i * 5 + j) % 61) for j in range(50)) for i in range(8)]
LORA = {"r": 4, "alpha": 8}


@pytest.fixture
def mha(tiny_model) -> Path:
    return tiny_model("llama", num_attention_heads=8, num_key_value_heads=8)


def convert(src: Path, out: Path, method: str = "mean") -> Path:
    from gqakit.convert import convert_checkpoint

    return convert_checkpoint(src, out, 2, method=method, progress=False)


def cfg(model: Path, out: Path, **train) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"texts": TEXTS, "eval_texts": EVAL},
        "train": {"tokens": 16 * 2 * 12, "seq_len": 16, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 2,
                  "precision": "fp32", "lora": LORA, **train},
        "eval": {"every": 6},
        "output": {"dir": str(out), "save_every": 6},
        "logging": {"every": 1, "tensorboard": False},
    }


def rows(out: Path) -> list[dict]:
    return [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]


def changed(before: Path, after: Path) -> dict[str, torch.Tensor]:
    a, b = load_causal_lm(before).state_dict(), load_causal_lm(after).state_dict()
    assert a.keys() == b.keys()
    return {k: b[k] - a[k] for k in a if not torch.equal(a[k], b[k])}


def test_lora_trains_adapters_and_exports_a_plain_merged_model(mha: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    conv = convert(mha, tmp_path / "g2")
    out = tmp_path / "run"
    final = run_uptrain(cfg(conv, out), quiet=True)
    # Plain folder: stock names only, loads with AutoModelForCausalLM and no peft involved.
    with safe_open(final / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    with safe_open(conv / "model.safetensors", "pt") as f:
        assert keys == set(f.keys())
    model = AutoModelForCausalLM.from_pretrained(final)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"
    # mean pooling changed K and V only: only they moved, each by a product of rank <= r.
    delta = changed(conv, final)
    assert delta and {k.split(".")[-2] for k in delta} == {"k_proj", "v_proj"}
    for d in delta.values():
        assert torch.linalg.matrix_rank(d) <= LORA["r"]
    # It learns, and the card records rank, targets and how much was trained.
    evals = [r["eval_ppl"] for r in rows(out) if "eval_ppl" in r]
    assert evals[-1] < evals[0]
    card = (final / "README.md").read_text()
    assert "| LoRA | rank 4, alpha 8, dropout 0 on self_attn.k_proj, self_attn.v_proj (" in card
    trained, total = (int(x.replace(",", "")) for x in card.split("LoRA | rank")[1].split("(")[1].split(" parameters")[0].split(" of "))
    c = model.config
    kv_width = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    assert trained == 2 * LORA["r"] * (c.hidden_size + kv_width) * c.num_hidden_layers  # A: r x in, B: out x r
    assert trained / total < 0.10


def test_checkpoint_holds_adapters_the_export_merges(mha: Path, tmp_path: Path):
    from safetensors.torch import load_file

    conv = convert(mha, tmp_path / "g2")
    out = tmp_path / "run"
    final = run_uptrain(cfg(conv, out), quiet=True)
    ckpt = load_file(out / "checkpoints" / "step-12" / "model.safetensors")
    assert any(".lora_A." in k for k in ckpt)
    merged = merged_state_dict(ckpt, load_config(cfg(conv, out)).train.lora)
    exported = load_causal_lm(final).state_dict()
    for k, v in exported.items():
        torch.testing.assert_close(v, merged[k], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_merge_reproduces_the_adapted_model(tiny_model, tmp_path: Path, family: str):
    """Merged weights give the wrapped model's logits (gpt2: Conv1D, stored transposed)."""
    conv = convert(tiny_model(family), tmp_path / "g2", method="align")
    c = load_config(cfg(conv, tmp_path / "o")).train
    wrapped, targets = apply_lora(load_causal_lm(conv), c, conv, "fp32")
    assert targets == default_targets(conv)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.3)  # B starts at zero: give the adapters something to merge
    x = torch.tensor([[1, 5, 6, 7, 9, 3]])
    want = wrapped(input_ids=x).logits
    plain = load_causal_lm(conv)
    fan = bool(wrapped.peft_config["default"].fan_in_fan_out)
    assert fan == (family == "gpt2")
    plain.load_state_dict(merged_state_dict(wrapped.state_dict(), c.lora, fan))
    torch.testing.assert_close(plain(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(load_causal_lm(conv)(input_ids=x).logits, want, atol=1e-3)


def test_default_targets_follow_the_conversion(mha: Path, tiny_model, tmp_path: Path):
    mean = convert(mha, tmp_path / "mean")
    assert json.loads((mean / "gqakit_convert.json").read_text())["changed"] == \
        {"decoder.self_attention": ["k_proj", "v_proj"]}
    assert default_targets(mean) == ["self_attn.k_proj", "self_attn.v_proj"]
    aligned = convert(mha, tmp_path / "align", method="align")
    assert default_targets(aligned) == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    gpt2 = convert(tiny_model("gpt2"), tmp_path / "gpt2", method="mean")
    assert default_targets(gpt2) == ["attn.c_attn"]
    # the targets are the record's, not the method name's: a record that says q changed gets q
    record = json.loads((mean / "gqakit_convert.json").read_text())
    (mean / "gqakit_convert.json").write_text(json.dumps({**record, "changed": {"decoder.self_attention": ["q_proj"]}}))
    assert default_targets(mean) == ["self_attn.q_proj"]
    # a record written before `changed` existed: the method table's `changes` for its method
    (mean / "gqakit_convert.json").write_text(json.dumps({k: v for k, v in record.items() if k != "changed"}))
    assert default_targets(mean) == ["self_attn.k_proj", "self_attn.v_proj"]
    old = {k: v for k, v in json.loads((gpt2 / "gqakit_convert.json").read_text()).items() if k != "changed"}
    (gpt2 / "gqakit_convert.json").write_text(json.dumps(old))
    assert default_targets(gpt2) == ["attn.c_attn"]
    # align: Q and O moved too.
    final = run_uptrain(cfg(aligned, tmp_path / "run", tokens=16 * 2 * 3), quiet=True)
    assert {k.split(".")[-2] for k in changed(aligned, final)} == {"q_proj", "k_proj", "v_proj", "o_proj"}


BASE = {"model": {"path": "/m"}, "data": {"texts": ["a b c"]}, "train": {"tokens": 1000, "lora": {}},
        "output": {"dir": "/o"}}


def test_config_defaults_and_overrides():
    lora = load_config(BASE).train.lora
    assert (lora.r, lora.alpha, lora.dropout, lora.targets) == (8, 16.0, 0.0, None)
    lora = load_config(BASE, ["train.lora.r=2", "train.lora.targets=[k_proj]"]).train.lora
    assert (lora.r, lora.targets) == (2, ["k_proj"])
    assert load_config({**BASE, "train": {"tokens": 1000}}).train.lora is None


@pytest.mark.parametrize("override, match", [
    ("train.lora.r=0", r"^config key 'train.lora.r': Input should be greater than 0 \(got 0\)$"),
    ("train.lora.r=-4", r"^config key 'train.lora.r': Input should be greater than 0"),
    ("train.lora.alpha=0", r"^config key 'train.lora.alpha'"),
    ("train.lora.dropout=1", r"^config key 'train.lora.dropout'"),
    ("train.lora.targets=[]", r"^config key 'train.lora.targets'"),
    ("train.lora.rank=4", r"^unknown config key 'train.lora.rank'$"),
    ("train.trainable=[self_attn]", r"^train.lora: does not combine with train.trainable"),
])
def test_config_errors_are_one_line(override: str, match: str):
    with pytest.raises(GqakitError, match=match) as e:
        load_config(BASE, [override])
    assert "\n" not in str(e.value)


def test_target_that_matches_nothing_is_one_line(mha: Path, tmp_path: Path):
    conv = convert(mha, tmp_path / "g2")
    out = tmp_path / "o"
    with pytest.raises(GqakitError, match=r"^train.lora.targets: 'qkv' matches no module of the model "
                                          r"\(its projections are named like 'model.layers.0.self_attn.q_proj'\)$"):
        run_uptrain(cfg(conv, out, lora={"targets": ["k_proj", "qkv"]}), quiet=True)
    assert not out.exists()  # checked before the run folder is made
    # the CLI: one line, exit 2
    (tmp_path / "c.json").write_text(json.dumps(cfg(conv, out)))
    r = subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(tmp_path / "c.json"), "-q",
                        "train.lora.targets=[nothing]"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "'nothing' matches no module" in r.stderr


def test_resume_with_other_lora_settings_is_refused(mha: Path, tmp_path: Path):
    conv = convert(mha, tmp_path / "g2")
    out = tmp_path / "run"
    run_uptrain(cfg(conv, out, tokens=16 * 2 * 6), quiet=True)
    with pytest.raises(GqakitError, match=r"^--resume: train.lora was .*'r': 4.* now .*'r': 2"):
        run_uptrain(cfg(conv, out, tokens=16 * 2 * 12, lora={"r": 2, "alpha": 8}), resume=True, quiet=True)
    # unchanged settings continue to the larger budget
    run_uptrain(cfg(conv, out, tokens=16 * 2 * 12), resume=True, quiet=True)
    assert [r["step"] for r in rows(out) if "loss" in r] == list(range(1, 13))


def test_lora_with_gradient_checkpointing_and_distillation(mha: Path, tmp_path: Path):
    """Checkpointed layers still pass gradients to the adapters (the embeddings are frozen),
    and the teacher-forced layer loss finds the decoder blocks inside peft's wrapper."""
    conv = convert(mha, tmp_path / "g2")
    a = run_uptrain(cfg(conv, tmp_path / "a", tokens=16 * 2 * 3), quiet=True)
    b = run_uptrain(cfg(conv, tmp_path / "b", tokens=16 * 2 * 3, gradient_checkpointing=True), quiet=True)
    la, lb = ([r["loss"] for r in rows(p.parent) if "loss" in r] for p in (a, b))
    assert la == pytest.approx(lb, rel=1e-5) and la[-1] != la[0]
    assert changed(conv, b).keys() == changed(conv, a).keys() != set()
    c = cfg(conv, tmp_path / "layer", tokens=16 * 2 * 6)
    c["teacher"] = {"path": str(mha), "kl_weight": 1.0, "lm_weight": 0.0, "hidden_weight": 1.0, "layer_weight": 1.0}
    run_uptrain(c, quiet=True)
    ls = [r["layer_mse"] for r in rows(tmp_path / "layer") if "layer_mse" in r]
    assert len(ls) == 6 and all(v > 0 for v in ls)


def test_bf16_compute_freezes_the_base_in_bf16(mha: Path, tmp_path: Path):
    """precision=bf16: the frozen weights are held in bf16 (no fp32 copy), the adapters in
    fp32; the export is fp32 with the frozen weights as their bf16 values."""
    conv = convert(mha, tmp_path / "g2")
    c = load_config(cfg(conv, tmp_path / "o", precision="bf16")).train
    wrapped, _ = apply_lora(load_causal_lm(conv), c, conv, "bf16")
    dtypes = {(".lora_" in n, p.dtype) for n, p in wrapped.named_parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    # its own process: accelerate keeps one mixed-precision setting per process
    (tmp_path / "bf16.json").write_text(json.dumps(cfg(conv, tmp_path / "run", precision="bf16", tokens=16 * 2 * 3)))
    subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(tmp_path / "bf16.json"), "-q"], check=True)
    final = tmp_path / "run" / "model"
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"
    before, after = load_causal_lm(conv).state_dict(), load_causal_lm(final).state_dict()
    for k, v in before.items():
        if ".k_proj." in k or ".v_proj." in k:
            assert not torch.equal(after[k], v.bfloat16().float()), k
        else:
            assert torch.equal(after[k], v.bfloat16().float()), k


def test_without_peft_the_error_is_one_line(mha: Path, tmp_path: Path, monkeypatch):
    conv = convert(mha, tmp_path / "g2")
    monkeypatch.setitem(sys.modules, "peft", None)  # as if it were not installed
    with pytest.raises(GqakitError, match=r"^train.lora needs the peft package: pip install 'peft>=0.21'$"):
        apply_lora(load_causal_lm(conv), load_config(cfg(conv, tmp_path / "o")).train, conv, "fp32")
