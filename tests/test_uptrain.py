"""End-to-end uptraining on pico models (CPU): output folder, loss bookkeeping, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gqakit.core.errors import GqakitError
from gqakit.core.loading import is_gqakit_output, load_causal_lm, load_tokenizer
from gqakit.uptrain import run_uptrain

# Pico tokenizer: single characters 33..93 separated by whitespace.
TEXTS = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40 + i % 9)) for i in range(60)]
EVAL = [" ".join(chr(33 + (i * 5 + j) % 61) for j in range(50)) for i in range(8)]


@pytest.fixture
def mha(tiny_model) -> Path:
    return tiny_model("llama", num_attention_heads=8, num_key_value_heads=8)


@pytest.fixture
def converted(mha: Path, tmp_path: Path) -> Path:
    """The pico llama (8 heads) converted to G=2 by the real converter."""
    from gqakit.convert import convert_checkpoint

    return convert_checkpoint(mha, tmp_path / "g2", 2, method="mean", progress=False)


def cfg(model: Path, out: Path, **train) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"texts": TEXTS, "eval_texts": EVAL},
        "train": {"tokens": 16 * 2 * 12, "seq_len": 16, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 2,
                  "precision": "fp32", **train},
        "eval": {"every": 6},
        "output": {"dir": str(out), "save_every": 6},
        "logging": {"every": 1, "tensorboard": False},
    }


def rows(out: Path) -> list[dict]:
    return [json.loads(r) for r in (out / "log.jsonl").read_text().splitlines()]


def test_end_to_end_output_is_a_loadable_gqa_model(converted: Path, tmp_path: Path):
    out = tmp_path / "run"
    final = run_uptrain(cfg(converted, out), quiet=True)
    assert final == out / "model" and is_gqakit_output(final)
    model = load_causal_lm(final)
    assert model.config.num_key_value_heads == 2
    # The KV cache holds G=2 heads, not 8.
    tok = load_tokenizer(final)
    x = torch.tensor([[1, 5, 6, 7]])
    cache = model(input_ids=x, use_cache=True).past_key_values
    assert cache.layers[0].keys.shape[1] == 2
    # Weights changed, and the card records the training facts.
    before = load_causal_lm(converted).state_dict()
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    card = (final / "README.md").read_text()
    log = rows(out)
    train_rows = [r for r in log if "loss" in r]
    evals = [r for r in log if "eval_ppl" in r]
    assert len(train_rows) == 12 and train_rows[-1]["tokens"] == 384
    assert f"{train_rows[-1]['loss']:.4f}" in card and "384" in card and f"{evals[-1]['eval_ppl']:.3f}" in card
    # Training helps: the held-out perplexity drops from step 0.
    assert evals[0]["step"] == 0 and evals[-1]["eval_ppl"] < evals[0]["eval_ppl"]
    assert (final / "gqakit_uptrain.yaml").is_file() and (final / "gqakit_convert.json").is_file()
    assert tok.get_vocab() == load_tokenizer(converted).get_vocab()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-12", "step-6"]


def test_grad_accum_equals_bigger_micro_batch(converted: Path, tmp_path: Path):
    """Same blocks per optimizer step: 2 micro-batches of 1 == 1 micro-batch of 2.

    The gradient norm is logged before clipping, so a wrong scale across accumulation
    steps (a mean of means, or accelerate's /grad_accum left in) would show here.
    """
    a = run_uptrain(cfg(converted, tmp_path / "a", micro_batch=2, grad_accum=1, tokens=16 * 2 * 4), quiet=True)
    b = run_uptrain(cfg(converted, tmp_path / "b", micro_batch=1, grad_accum=2, tokens=16 * 2 * 4), quiet=True)
    ra = [r for r in rows(a.parent) if "loss" in r]
    rb = [r for r in rows(b.parent) if "loss" in r]
    for x, y in zip(ra, rb, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    wa, wb = load_causal_lm(a).state_dict(), load_causal_lm(b).state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_distillation_logs_kl_and_teacher_must_share_tokenizer(converted: Path, mha: Path, tiny_model, tmp_path: Path):
    teacher = mha
    def kl_to_teacher(folder: Path) -> float:
        x = load_tokenizer(folder)(EVAL, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            s = torch.log_softmax(load_causal_lm(folder)(input_ids=x).logits, -1)
            t = torch.log_softmax(load_causal_lm(teacher)(input_ids=x).logits, -1)
        return float((t.exp() * (t - s)).sum(-1).mean())

    plain = run_uptrain(cfg(converted, tmp_path / "plain"), quiet=True)
    c = cfg(converted, tmp_path / "kd")
    c["teacher"] = {"path": str(teacher), "kl_weight": 5.0}
    kd = run_uptrain(c, quiet=True)
    kls = [r["kl"] for r in rows(tmp_path / "kd") if "kl" in r]
    assert len(kls) == 12 and all(k > 0 for k in kls)
    # The KL term pulls the student towards the teacher, compared with the LM loss alone.
    assert kl_to_teacher(kd) < kl_to_teacher(plain)

    other = tiny_model("llama")
    tj = json.loads((other / "tokenizer.json").read_text())
    tj["model"]["vocab"] = {("X" + k if v > 10 else k): v for k, v in tj["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(tj))
    c["teacher"]["path"] = str(other)
    with pytest.raises(GqakitError, match="teacher.path: the tokenizer"):
        run_uptrain(c, overwrite=True, quiet=True)


def test_teacher_samples_are_cached(converted: Path, mha: Path, tmp_path: Path):
    from gqakit.uptrain.config import TeacherSamplesCfg
    from gqakit.uptrain.data import teacher_samples_file

    teacher = mha
    ts = TeacherSamplesCfg(num=6, length=20, batch_size=4)
    f = teacher_samples_file(ts, teacher, tmp_path / "cache")
    docs = [json.loads(r)["text"] for r in f.read_text().splitlines()]
    assert len(docs) >= 6 and all(isinstance(d, str) for d in docs)
    mtime = f.stat().st_mtime_ns
    assert teacher_samples_file(ts, teacher, tmp_path / "cache") == f and f.stat().st_mtime_ns == mtime
    # A run on teacher samples trains end to end.
    c = cfg(converted, tmp_path / "ts", tokens=16 * 2 * 2)
    c["teacher"] = {"path": str(teacher)}
    c["data"] = {"teacher_samples": {"num": 24, "length": 40, "batch_size": 24}, "cache_dir": str(tmp_path / "cache")}
    assert run_uptrain(c, quiet=True).is_dir()


def test_tokenization_is_cached_by_datasets(converted: Path, tmp_path: Path):
    from gqakit.uptrain.data import load_documents, tokenize

    f = tmp_path / "train.txt"
    f.write_text("\n\n".join(TEXTS))
    tok = load_tokenizer(converted)
    kw = dict(text_field="text", sample_by="paragraph", cache_dir=tmp_path / "c", what="data.files")
    first = tokenize(load_documents([f], **kw), tok, add_bos=True)
    files = [c["filename"] for c in first.cache_files]
    mtimes = [Path(p).stat().st_mtime_ns for p in files]
    second = tokenize(load_documents([f], **kw), tok, add_bos=True)
    assert [c["filename"] for c in second.cache_files] == files
    assert [Path(p).stat().st_mtime_ns for p in files] == mtimes
    assert len(first) == len(TEXTS) and first[0]["input_ids"][0] == tok.bos_token_id


def test_block_order_shards_the_same_global_batch():
    from gqakit.uptrain.data import BlockOrder

    one = BlockOrder(50, seed=3, micro=2, accum=4, world=1, rank=0)
    two = [BlockOrder(50, seed=3, micro=2, accum=2, world=2, rank=r) for r in range(2)]
    for step in range(20):  # crosses several epochs
        a = sorted(i for k in range(4) for i in one.indices(step, k))
        b = sorted(i for o in two for k in range(2) for i in o.indices(step, k))
        assert a == b and len(set(a)) == 8
    # Each epoch is a permutation: all 50 blocks once in the first 50 samples.
    seen = [i for s in range(7) for k in range(4) for i in one.indices(s, k)][:50]
    assert sorted(seen) == list(range(50))


# ----------------------------------------------------------------------------- errors


def _expect(c: dict, match: str, **kw) -> None:
    with pytest.raises(GqakitError, match=match):
        run_uptrain(c, quiet=True, **kw)


def test_errors_model_and_lengths(converted: Path, tiny_model, tmp_path: Path):
    plain = tiny_model("llama")
    _expect(cfg(plain, tmp_path / "o"), "not a converted model")
    _expect(cfg(converted, tmp_path / "o", seq_len=4096), "train.seq_len: 4096 is longer than the model's 128")
    _expect(cfg(converted, tmp_path / "o", tokens=10), "less than one optimizer step")


def test_errors_data_files(converted: Path, tmp_path: Path):
    c = cfg(converted, tmp_path / "o")
    c["data"] = {"files": [str(tmp_path / "nothing*.txt")]}
    _expect(c, "data.files: no file matches")
    empty = tmp_path / "empty.txt"
    empty.touch()
    c["data"] = {"files": [str(empty)]}
    _expect(c, "empty.txt is empty")
    train = tmp_path / "train.txt"
    train.write_text("\n\n".join(TEXTS))
    c["data"] = {"files": [str(tmp_path / "*.txt")], "eval_file": str(train)}
    empty.unlink()
    _expect(c, "data.eval_file: .*is also a training file")


def test_errors_output_folder(converted: Path, tmp_path: Path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "x").write_text("keep me")
    _expect(cfg(converted, out), "not empty; pass --overwrite")
    assert (out / "x").read_text() == "keep me"
    _expect(cfg(converted, out), "no checkpoint", resume=True)
    _expect(cfg(converted, converted / "sub"), "is inside the model.path")


def test_divergence_stops_before_a_bad_checkpoint(converted: Path, tmp_path: Path):
    from safetensors.torch import load_file

    out = tmp_path / "nan"
    # An absurd learning rate without clipping blows the weights up within a few steps.
    c = cfg(converted, out, lr=1e12, grad_clip=None, warmup_steps=0, tokens=16 * 2 * 40)
    c["output"]["save_every"] = 1
    with pytest.raises(GqakitError, match=r"training diverged at step (\d+): .*NaN/inf; stopped before it reached "
                                          r"a checkpoint \(the last good checkpoint is (\S+)\)") as e:
        run_uptrain(c, quiet=True)
    step = int(str(e.value).split("step ")[1].split(":")[0])
    named = Path(str(e.value).split("checkpoint is ")[1].split(")")[0])
    ckpts = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*"))
    assert ckpts[-1] == step - 1 and named == out / "checkpoints" / f"step-{step - 1}" and not (out / "model").exists()
    for p in (out / "checkpoints").glob("step-*"):
        assert all(torch.isfinite(v).all() for v in load_file(p / "model.safetensors").values()), p
    assert all(math.isfinite(r["loss"]) for r in rows(out) if "loss" in r)


def test_gradient_checkpointing_gives_the_same_run(converted: Path, tmp_path: Path):
    a = run_uptrain(cfg(converted, tmp_path / "a", tokens=16 * 2 * 3), quiet=True)
    b = run_uptrain(cfg(converted, tmp_path / "b", tokens=16 * 2 * 3, gradient_checkpointing=True), quiet=True)
    la = [r["loss"] for r in rows(a.parent) if "loss" in r]
    lb = [r["loss"] for r in rows(b.parent) if "loss" in r]
    assert la == pytest.approx(lb, rel=1e-5)


def test_trainable_freezes_everything_else(converted: Path, tmp_path: Path):
    final = run_uptrain(cfg(converted, tmp_path / "t", tokens=16 * 2 * 3, trainable=[r"self_attn\.(k|v)_proj"]), quiet=True)
    before, after = load_causal_lm(converted).state_dict(), load_causal_lm(final).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".k_proj." in k or ".v_proj." in k for k in changed)
    _expect(cfg(converted, tmp_path / "u", trainable=["nothing_matches"]), "train.trainable: no parameter")


def test_remote_code_family_keeps_its_modeling_file(tiny_model, tmp_path: Path):
    """gpt2 has no stock GQA: the output must keep gqakit's modeling file and auto_map."""
    from gqakit.convert import convert_checkpoint

    conv = convert_checkpoint(tiny_model("gpt2"), tmp_path / "gpt2-g2", 2, progress=False)
    final = run_uptrain(cfg(conv, tmp_path / "run", tokens=16 * 2 * 2), quiet=True)
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (conv, final))
    assert out_cfg["auto_map"] == src_cfg["auto_map"]
    for py in conv.glob("gqakit_modeling_*.py"):
        assert (final / py.name).read_text() == py.read_text()
    model = load_causal_lm(final)
    x = torch.tensor([[1, 5, 6, 7]])
    logits = model(input_ids=x).logits
    assert torch.isfinite(logits).all() and logits.shape == (1, 4, 64)


def test_sample_tokens_is_generate_with_a_static_cache(mha: Path):
    """The fast sampler: top_k=1 is greedy decoding, identical to `generate`; sampling is seeded."""
    from gqakit.core.tokens import sample_tokens

    model = load_causal_lm(mha).eval()
    prompt = [1, 5, 6]
    x = torch.tensor([prompt] * 3)
    greedy = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                            pad_token_id=0)[:, len(prompt):]
    assert torch.equal(sample_tokens(model, prompt, 3, 12, top_k=1), greedy)
    a = sample_tokens(model, [1], 4, 10, generator=torch.Generator().manual_seed(0))
    b = sample_tokens(model, [1], 4, 10, generator=torch.Generator().manual_seed(0))
    assert a.shape == (4, 10) and torch.equal(a, b) and int(a.max()) < model.config.vocab_size
    # Temperature 1 samples the full distribution: the first token's frequencies follow softmax.
    n = 4000
    first = sample_tokens(model, [1], n, 1, generator=torch.Generator().manual_seed(1))[:, 0]
    with torch.no_grad():
        p = torch.softmax(model(input_ids=torch.tensor([[1]])).logits[0, -1], -1)
    freq = torch.bincount(first, minlength=p.numel()).double() / n
    assert (freq - p.double()).abs().max() < 0.03


def test_hidden_state_distillation(converted: Path, mha: Path, tmp_path: Path):
    """teacher.hidden_weight adds a residual-stream MSE: 0 for the teacher itself, logged, and it trains."""
    from gqakit.uptrain.losses import token_losses

    teacher = load_causal_lm(mha)
    x = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        ce, kl, mse, _, n = token_losses(teacher, x, teacher, 1.0, hidden=True)
        assert float(kl) == pytest.approx(0.0, abs=1e-5) and float(mse) == 0.0 and n == 5
        _, _, mse_s, _, _ = token_losses(load_causal_lm(converted), x, teacher, 1.0, hidden=True)
        assert float(mse_s) > 0
        assert float(token_losses(load_causal_lm(converted), x, teacher, 1.0)[2]) == 0.0  # off by default

    c = cfg(converted, tmp_path / "hid")
    c["teacher"] = {"path": str(mha), "kl_weight": 1.0, "lm_weight": 0.0, "hidden_weight": 1.0}
    run_uptrain(c, quiet=True)
    hs = [r["hidden_mse"] for r in rows(tmp_path / "hid") if "hidden_mse" in r]
    assert len(hs) == 12 and all(h > 0 for h in hs) and hs[-1] < hs[0]

    c = cfg(converted, tmp_path / "x")
    c["teacher"] = {"hidden_weight": 1.0}
    with pytest.raises(GqakitError, match="missing required settings: teacher.path"):
        run_uptrain(c, quiet=True)


def _perturb_k(model, layers: list[int]):
    for i in layers:  # one fixed perturbation per layer, whichever others are perturbed too
        w = model.model.layers[i].self_attn.k_proj.weight
        w.data += 0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(i))
    return model


def test_layer_local_distillation_is_teacher_forced(mha: Path, converted: Path, tmp_path: Path):
    """teacher.layer_weight feeds each student layer the teacher's input: the error of one
    layer does not reach the next, so per-layer errors add up (the free-running hidden-state
    term does not); 0 for the teacher itself; no hook is left behind; it trains."""
    from gqakit.core.loaded import decoder_blocks
    from gqakit.uptrain.losses import token_losses

    teacher = load_causal_lm(mha)
    x = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [1, 9, 8, 7, 6, 5, 4, 3]])
    hooks = [len(m._forward_pre_hooks) for m in decoder_blocks(teacher)]
    with torch.no_grad():
        assert float(token_losses(teacher, x, teacher, 1.0, layer=True).layer) == 0.0
        first, second, both = (token_losses(_perturb_k(load_causal_lm(mha), ls), x, teacher, 1.0, hidden=True, layer=True)
                            for ls in ([0], [1], [0, 1]))
    assert float(first.layer) > 0 and float(second.layer) > 0
    assert float(first.layer + second.layer) == pytest.approx(float(both.layer), rel=1e-5)
    assert float(first.hidden + second.hidden) != pytest.approx(float(both.hidden), rel=1e-3)
    assert [len(m._forward_pre_hooks) for m in decoder_blocks(teacher)] == hooks

    c = cfg(converted, tmp_path / "layer")
    c["teacher"] = {"path": str(mha), "kl_weight": 0.0, "lm_weight": 0.0, "layer_weight": 1.0}
    run_uptrain(c, quiet=True)
    ls = [r["layer_mse"] for r in rows(tmp_path / "layer") if "layer_mse" in r]
    assert len(ls) == 12 and all(v > 0 for v in ls) and ls[-1] < ls[0]
    evals = [r["eval_ppl"] for r in rows(tmp_path / "layer") if "eval_ppl" in r]
    assert evals[-1] < evals[0]
    c["train"]["gradient_checkpointing"] = True
    with pytest.raises(GqakitError, match="layer_weight: does not combine with train.gradient_checkpointing"):
        run_uptrain(c, quiet=True)


def test_tensorboard_logging(converted: Path, tmp_path: Path):
    """logging.tensorboard (default on) writes the same scalars as log.jsonl through accelerate's tracker."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    c = cfg(converted, tmp_path / "tb")
    c["logging"]["tensorboard"] = True
    run_uptrain(c, quiet=True)
    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert events, "no tensorboard event file"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    loss = [e.value for e in acc.Scalars("loss")]
    assert [e.step for e in acc.Scalars("loss")] == list(range(1, 13))
    assert loss == pytest.approx([r["loss"] for r in rows(tmp_path / "tb") if "loss" in r], rel=1e-6)
    assert len(acc.Scalars("eval_ppl")) == 3  # steps 0, 6, 12
    # The final model folder is unchanged by the tracker: no event files leak into it.
    assert not list((tmp_path / "tb" / "model").rglob("events.out.tfevents.*"))
