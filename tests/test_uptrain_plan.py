"""The uptraining memory plan: `gqakit uptrain --dry-run` and the first row of a run's log.

The plan counts the model with fake tensors; these tests check its numbers against an
independent count on a real pico model (real tensors, a real forward pass).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from gqakit.core.errors import GqakitError
from gqakit.core.loading import load_config as load_hf_config
from gqakit.uptrain.losses import token_losses
from gqakit.uptrain.plan import Settings, Target, compose, device_memory_size, make_plan

TEXTS = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40 + i % 9)) for i in range(60)]


@pytest.fixture
def converted(tiny_model, tmp_path: Path) -> Path:
    from gqakit.convert import convert_checkpoint

    mha = tiny_model("llama", num_attention_heads=8, num_key_value_heads=8)
    return convert_checkpoint(mha, tmp_path / "g2", 2, method="mean", progress=False)


def config(model: Path, out: Path, **train) -> dict:
    return {"model": {"path": str(model)}, "data": {"texts": TEXTS},
            "train": {"tokens": 16 * 2 * 3, "seq_len": 16, "micro_batch": 2, "precision": "fp32", **train},
            "output": {"dir": str(out)}, "logging": {"every": 1, "tensorboard": False}}


def dry_run(cfg: dict, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(path), "--dry-run", *args],
                          capture_output=True, text=True)


def test_dry_run_prints_the_plan_without_weights_and_writes_nothing(converted: Path, tmp_path: Path):
    # a copy of the model folder without its weights: the plan reads config.json only
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in converted.iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            shutil.copy2(f, bare / f.name)
    out = tmp_path / "run"
    before = sorted(p.name for p in tmp_path.iterdir())
    r = dry_run(config(bare, out), tmp_path, "--device-memory", "24GB")
    # a run would not start without the weights: the dry run says so, after the whole plan
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "holds no weights" in r.stderr, r.stderr
    assert "seq_len: 16" in r.stdout  # the resolved config comes first
    yaml.safe_load(r.stdout)  # the plan lines are YAML comments: the output stays valid YAML
    plan = [ln for ln in r.stdout.splitlines() if ln.startswith("#")]
    text = "\n".join(plan)
    for part in ("weights float32", "gradients fp32", "optimizer state", "activations", "with gradient_checkpointing",
                 "peak", "fits 24GB device"):
        assert part in text, text
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["c.yaml"])


def test_a_plan_that_fits_no_device_named_is_one_line(converted: Path, tmp_path: Path):
    r = dry_run(config(converted, tmp_path / "run"), tmp_path, "--device-memory", "0.0001MiB")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gqakit: error: the plan needs"), r.stderr


@pytest.mark.parametrize("args, words", [
    (["--device-memory", "lots"], "not a size"),
    (["--device-memory", "0GB"], "more than zero"),
    (["--accelerate-config", "/nonexistent/acc.yaml"], "is not a file"),
])
def test_bad_plan_options_are_one_line(converted: Path, tmp_path: Path, args, words):
    r = dry_run(config(converted, tmp_path / "run"), tmp_path, *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr


def test_plan_options_need_dry_run(converted: Path, tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config(converted, tmp_path / "run")))
    r = subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(path), "--device-memory", "80GB"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "add --dry-run" in r.stderr and not (tmp_path / "run").exists()


def test_unknown_config_key_is_still_refused(converted: Path, tmp_path: Path):
    cfg = config(converted, tmp_path / "run")
    cfg["train"]["memory_budget"] = 1
    r = dry_run(cfg, tmp_path)
    assert r.returncode == 2 and "unknown config key 'train.memory_budget'" in r.stderr


def test_sizes_parse():
    assert device_memory_size("80GB") == device_memory_size("80GiB") == device_memory_size("80") == 80 * 2**30
    assert device_memory_size("512MiB") == 2**29
    with pytest.raises(GqakitError, match="is not a size"):
        device_memory_size("-3GB")
    with pytest.raises(GqakitError, match="--device-memory: '0GB' must be more than zero"):
        device_memory_size("0GB")


def _real_saved_bytes(model, x, trainable_dtype=None) -> int:
    """Bytes autograd keeps for the backward pass of the real model on real tensors."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_losses(model, x, None, 1.0)
    return sum(seen.values())


@pytest.mark.parametrize("trainable", [None, [r"self_attn"]])
def test_plan_numbers_match_an_independent_count(converted: Path, trainable):
    from gqakit.core.loading import load_causal_lm

    model = load_causal_lm(converted).train()
    model.config.use_cache = False
    if trainable:
        for name, p in model.named_parameters():
            p.requires_grad_("self_attn" in name)
    params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    seq, micro = 16, 3
    saved = _real_saved_bytes(model, torch.randint(0, 60, (micro, seq)))

    s = Settings(seq, micro, 1, False, tuple(trainable) if trainable else None, "fp32")
    plan = make_plan(load_hf_config(converted), s, Target(1, "none", "cpu"))
    assert (plan.params, plan.trained) == (params, trained)
    assert plan.parts["weights float32"] == 4 * params
    assert plan.parts["gradients fp32"] == 4 * trained
    assert plan.parts["optimizer state (AdamW, 2 x fp32)"] == 8 * trained
    assert plan.parts["activations"] == saved
    assert plan.peak == 4 * params + 8 * trained + max(saved + plan.parts["backward scratch"], 4 * trained)
    # activations scale with the micro-batch; checkpointing keeps less
    double = compose(plan.counts, Settings(seq, 2 * micro, 2, False, s.trainable, "fp32"), plan.target, micro)
    assert double.parts["activations"] == 2 * saved
    assert plan.activations_other < saved


def test_frozen_weights_are_planned_in_the_compute_dtype_and_sharded_by_fsdp(converted: Path):
    hf = load_hf_config(converted)
    all_w = make_plan(hf, Settings(16, 2, 1, False, None, "bf16"), Target(1, "none", "cuda"))
    att = make_plan(hf, Settings(16, 2, 1, False, ("self_attn",), "bf16"), Target(1, "none", "cuda"))
    frozen = att.params - att.trained
    assert att.parts["weights float32"] == 4 * att.trained and att.parts["weights bfloat16"] == 2 * frozen
    assert all_w.parts["weights float32"] == 4 * all_w.params and "weights bfloat16" not in all_w.parts
    fsdp = make_plan(hf, Settings(16, 2, 1, False, None, "bf16"), Target(4, "fsdp", "cuda"))
    assert fsdp.parts["optimizer state (AdamW, 2 x fp32)"] == 8 * fsdp.trained // 4
    ddp = make_plan(hf, Settings(16, 2, 1, False, None, "bf16"), Target(2, "ddp", "cuda"))
    assert ddp.parts["DDP gradient buckets"] == 4 * ddp.trained and ddp.peak > all_w.peak


def test_the_run_logs_its_plan_first_and_keeps_frozen_weights_in_bf16(converted: Path, tmp_path: Path):
    out = tmp_path / "run"
    cfg = config(converted, out, precision="bf16", trainable=[r"self_attn\.(k|v)_proj"])
    cfg["output"]["save_every"] = 3
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # its own process: accelerate's precision is fixed once per process
    r = subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(path), "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    final = out / "model"
    first = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    plan = first["memory_plan"]
    assert first["step"] == 0 and plan["peak_bytes"] > 0 and plan["precision"] == "bf16"
    assert plan["parts_bytes"]["weights bfloat16"] > 0  # the frozen weights
    # the checkpoint holds the frozen weights in bf16 and the trained ones in fp32
    from safetensors import safe_open

    ckpt = next((out / "checkpoints").iterdir())
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if "k_proj" in k or "v_proj" in k} == {"F32"}
    assert {d for k, d in dtypes.items() if "mlp" in k} == {"BF16"}
    # the exported folder holds the frozen weights exactly as the source did (fp32 here)
    from safetensors.torch import load_file

    src, got = load_file(str(converted / "model.safetensors")), load_file(str(final / "model.safetensors"))
    for k, v in src.items():
        if "mlp" in k or "norm" in k:
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_suggestions_name_the_cheapest_change_that_fits(converted: Path):
    from dataclasses import replace

    from gqakit.uptrain.plan import suggestions

    plan = make_plan(load_hf_config(converted), Settings(64, 4, 1, False, None, "fp32"), Target(1, "none", "cpu"))
    ckpt = compose(plan.counts, replace(plan.settings, checkpointing=True), plan.target, 4)
    assert ckpt.peak < plan.peak
    got = suggestions(plan, ckpt.peak)
    assert got and got[0].startswith("train.gradient_checkpointing=true (peak")
    half = compose(plan.counts, replace(plan.settings, micro_batch=2, grad_accum=2), plan.target, 4)
    assert half.peak < plan.peak and half.parts["activations"] * 2 == plan.parts["activations"]


def _lora_model(converted: Path, targets: list[str], r: int, dropout: float):
    """The pico model wrapped as the trainer wraps it for train.lora (fp32: the CPU)."""
    from types import SimpleNamespace

    from gqakit.core.loading import load_causal_lm
    from gqakit.uptrain.lora import wrap

    model = load_causal_lm(converted).train()
    model.config.use_cache = False
    return wrap(model, SimpleNamespace(r=r, alpha=16.0, dropout=dropout), targets, "fp32")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_plan_counts_the_adapters_and_their_activations(converted: Path, dropout: float):
    from gqakit.uptrain.plan import LoraPlan

    targets = ["self_attn.k_proj", "self_attn.v_proj"]
    hf = load_hf_config(converted)
    r = 4
    model = _lora_model(converted, targets, r, dropout)
    seq, micro = 16, 3
    torch.manual_seed(0)
    saved = _real_saved_bytes(model, torch.randint(0, 60, (micro, seq)))
    base_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    hidden, layers = hf.hidden_size, hf.num_hidden_layers
    kv_out = hf.num_key_value_heads * (hidden // hf.num_attention_heads)
    adapters = layers * 2 * r * (hidden + kv_out)  # r x (in + out) per targeted projection

    lora = LoraPlan(r, 16.0, dropout, tuple(targets))
    plan = make_plan(hf, Settings(seq, micro, 1, False, None, "fp32", lora), Target(1, "none", "cpu"))
    assert plan.trained == adapters and plan.params == base_params + adapters
    assert plan.parts["gradients fp32"] == 4 * adapters
    assert plan.parts["optimizer state (AdamW, 2 x fp32)"] == 8 * adapters
    assert plan.parts["activations"] == saved
    # on a GPU: the base frozen in bf16, the adapters' master weights fp32
    gpu = make_plan(hf, Settings(seq, micro, 1, False, None, "bf16", lora), Target(1, "none", "cuda"))
    assert gpu.parts["weights bfloat16"] == 2 * base_params and gpu.parts["weights float32"] == 4 * adapters
    assert gpu.row()["memory_plan"]["lora"] == {"r": r, "targets": targets}
    # no suggestion to train attention instead: it does not combine with LoRA
    from gqakit.uptrain.plan import suggestions

    assert not any("trainable" in s for s in suggestions(gpu, 1, recount=lambda p: pytest.fail("recounted")))


def test_lora_dry_run_resolves_the_default_targets_and_the_run_logs_the_same_peak(converted: Path, tmp_path: Path):
    out = tmp_path / "run"
    cfg = config(converted, out, lora={"r": 4})
    r = dry_run(cfg, tmp_path, "--device-memory", "24GB")
    assert r.returncode == 0, r.stderr
    head = next(ln for ln in r.stdout.splitlines() if ln.startswith("# memory plan per process"))
    assert "LoRA r 4 on self_attn.k_proj, self_attn.v_proj" in head, head  # mean pooling: K and V
    peak = next(ln for ln in r.stdout.splitlines() if ln.strip("# ").startswith("peak"))
    path = tmp_path / "c.yaml"
    r = subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(path), "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    plan = json.loads((out / "log.jsonl").read_text().splitlines()[0])["memory_plan"]
    from gqakit.uptrain.plan import gib

    assert gib(plan["peak_bytes"]) in peak and plan["lora"]["targets"] == ["self_attn.k_proj", "self_attn.v_proj"]
    hf = load_hf_config(converted)
    assert plan["trained"] == hf.num_hidden_layers * 2 * 4 * (hf.hidden_size + hf.num_key_value_heads * hf.head_dim)


def test_dry_run_of_an_encoder_decoder_says_the_plan_is_for_decoder_only_models(tmp_path: Path):
    from transformers import T5Config

    folder = tmp_path / "t5"
    folder.mkdir()
    T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=64).save_pretrained(folder)
    r = dry_run(config(folder, tmp_path / "run"), tmp_path)
    # a bare config.json is no converted model (a problem), but the plan is still made from it
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"gqakit: error: model.path: {folder} is not a converted model (no gqakit_convert.json); " \
        "run `gqakit convert` first"
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("# memory plan")]
    assert lines == ["# memory plan: none; it covers decoder-only models, and t5 is an encoder-decoder (t5)"], r.stdout
