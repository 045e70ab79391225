"""The layer-streamed align-refit stage: same answer as the in-memory implementation it
replaced, one decoder block materialised at a time, validated options, offload modes."""

from __future__ import annotations

import json
import weakref

import pytest
import torch

from gqakit.convert.calibration import CalibrationStage, calibration_sequences
from gqakit.convert.pipeline import convert_checkpoint
from gqakit.convert.plan import make_plan
from gqakit.convert.source import open_model
from gqakit.convert.refit_options import RefitOptions
from gqakit.convert.settings import ConvertSettings
from gqakit.core.errors import GqakitError, Interrupted
from reference_calibrate import reference_refit


def _streamed(src, settings, **kw):
    opened = open_model(src)
    plan = make_plan(opened, settings)
    stage = CalibrationStage(opened, plan, plan.settings, device="cpu", progress=False, **kw)
    return dict(stage.layers()), stage.summary, opened, plan


def _reference(src, settings):
    opened = open_model(src)
    plan = make_plan(opened, settings)
    settings = plan.settings  # resolved for this model
    opts = settings.options
    seqs, _ = calibration_sequences(opened, settings.calibration_data, settings.calibration_tokens,
                                    opts.seq_len, settings.seed, sample_batch=opts.sample_batch,
                                    progress=False, source_params=plan.source_params)
    batches = list(seqs.split(4 if opts.batch == "auto" else opts.batch))  # the CPU's auto batch
    return reference_refit(opened, plan, settings, batches, opts.model_dump())


def _assert_same_heads(got, ref, rtol=1e-7, atol=1e-9):
    assert sorted(got) == sorted(ref)
    for L in ref:
        for part in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias"):
            a, b = getattr(got[L], part), getattr(ref[L], part)
            assert (a is None) == (b is None), (L, part)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=f"layer {L} {part}")


CASES = [  # rotate-half, biases, fused transposed QKV, fused interleaved + partial rotary, no rotary
    ("llama", {"num_key_value_heads": 4}, 2, {}),
    ("qwen2", {"num_key_value_heads": 4}, 1, {"holdout": 0.25, "skip_first": 1}),
    ("gpt2", {}, 2, {"row_weight": "none"}),
    ("gpt_neox", {}, 2, {"target": "local"}),
    ("opt", {}, 1, {}),
    ("phi", {}, 2, {"o_ridge": -1}),
    # the families with their own twists: per-layer-type masks, fused [q|k|v] rows, q/k norms
    ("gemma2", {}, 2, {"seq_len": 64}),
    ("phi3", {}, 4, {}),
    ("olmo", {}, 2, {}),
    ("qwen3", {}, 1, {}),
    ("stablelm", {}, 2, {}),
]


@pytest.mark.parametrize("family, overrides, g, opts", CASES, ids=[c[0] for c in CASES])
def test_streamed_matches_in_memory_reference(tiny_model, one_thread, family, overrides, g, opts):
    src = tiny_model(family, **overrides)
    settings = ConvertSettings(source=src, num_kv_heads=g, method="align-refit", calibration_tokens=640,
                               grouping="contiguous", effort="fast", refit={"seq_len": 32, "batch": 4, **opts})
    got, summary, _, plan = _streamed(src, settings)
    ref = _reference(src, settings)
    _assert_same_heads(got, ref["layers"])
    assert summary["residual_drift"] == pytest.approx(ref["residual_drift"], rel=1e-6, abs=1e-12)
    assert summary["residual_drift_first"] == pytest.approx(ref["residual_drift_first"], rel=1e-6, abs=1e-12)
    assert len(summary["residual_drift"]) == plan.shape.num_layers - 1


@pytest.mark.assets
def test_streamed_matches_in_memory_reference_on_stories260k(shared, one_thread):
    """Real trained weights, both calibration sources: text sampled from the model, and a file."""
    src = shared / "models" / "stories260K"
    for data in (None, str(shared / "data" / "tinystories" / "valid-excerpt.txt")):
        settings = ConvertSettings(source=src, num_kv_heads=2, method="align-refit",
                                   calibration_data=data, calibration_tokens=2048, grouping="contiguous",
                                   effort="fast", refit={"seq_len": 128})
        got, _, _, _ = _streamed(src, settings)
        _assert_same_heads(got, _reference(src, settings)["layers"])


class _BlockWatch:
    """Every decoder block instance of a class, and the most layers ever holding real weights
    at once (checked each time any module runs)."""

    def __init__(self, monkeypatch, cls):
        self.blocks: weakref.WeakSet = weakref.WeakSet()
        self.most = 0
        init = cls.__init__

        def tracked_init(mod, *a, **k):
            init(mod, *a, **k)
            self.blocks.add(mod)

        monkeypatch.setattr(cls, "__init__", tracked_init)
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._check)

    def _check(self, module, args):
        live = {id(b) for b in self.blocks if any(p.device.type != "meta" for p in b.parameters(recurse=True))}
        self.most = max(self.most, len(live))

    def close(self):
        self.handle.remove()


def test_never_more_than_one_block_materialised(tiny_model, tmp_path, monkeypatch, one_thread):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=4)
    data = tmp_path / "calib.txt"
    data.write_text("abc def ghi jkl mno pqr stu vwx yz " * 200)
    settings = ConvertSettings(source=src, num_kv_heads=1, method="align-refit",
                               calibration_data=str(data), calibration_tokens=512, effort="fast",
                               grouping="contiguous", refit={"seq_len": 32})
    watch = _BlockWatch(monkeypatch, LlamaDecoderLayer)
    try:
        _streamed(src, settings)
        assert 0 < watch.most <= 1, f"{watch.most} decoder blocks held real weights at once"
        # the watch can fail: the in-memory implementation holds every block at once
        watch.most = 0
        _reference(src, settings)
        assert watch.most == 4
    finally:
        watch.close()


def test_offload_modes_and_stream_dtype_give_the_same_answer(tiny_model, tmp_path, one_thread):
    src = tiny_model("llama", num_key_value_heads=4)
    base = {"seq_len": 32, "batch": 4}
    runs = {}
    for off in ("cpu", "disk"):
        settings = ConvertSettings(source=src, num_kv_heads=2, method="align-refit",
                                   calibration_tokens=256, refit={**base, "offload": off})
        runs[off], summary, _, _ = _streamed(src, settings, scratch=tmp_path / off)
        assert summary["streams_on"] == off
    _assert_same_heads(runs["disk"], runs["cpu"], rtol=0, atol=0)
    assert (tmp_path / "disk" / "calibration-streams" / "orig.bin").is_file()
    # a 16-bit storage dtype for the streams changes the answer a little, not a lot
    settings = ConvertSettings(source=src, num_kv_heads=2, method="align-refit", calibration_tokens=256,
                               refit={**base, "stream_dtype": "bfloat16"})
    low, summary, _, _ = _streamed(src, settings)
    assert summary["stream_dtype"] == "bfloat16"
    for L in low:
        assert (low[L].o - runs["cpu"][L].o).norm() < 0.1 * runs["cpu"][L].o.norm()


@pytest.mark.parametrize("opts, needle", [
    ({"progres": False}, "unknown align-refit option"),
    ({"seq_len": 1}, "seq_len must be an integer >= 2"),
    ({"holdout": 1.0}, "holdout must be in"),
    ({"q_ridge": float("nan")}, "finite number"),
    ({"offload": "tape"}, "choose from auto, device, cpu, disk"),
    ({"batch": True}, "batch must be an integer"),
    ({"steps": -1}, "steps must be an integer >= 0"),
    ({"steps": 2.5}, "steps must be an integer >= 0"),
    ({"lr": 0}, "lr must be > 0"),
    ({"guard_spans": 0}, "guard_spans must be an integer >= 1"),
    ({"final_o": "yes"}, "final_o must be true or false"),
    ({"final_o": 1}, "final_o must be true or false"),
])
def test_refit_options_are_validated(opts, needle):
    with pytest.raises(GqakitError, match=needle):
        RefitOptions.parse(opts)


def test_bad_options_fail_before_anything_is_written(tiny_model, tmp_path):
    src = tiny_model("llama", num_key_value_heads=4)
    with pytest.raises(GqakitError, match="unknown align-refit option"):
        convert_checkpoint(src, tmp_path / "out", 2, "align-refit", options={"sed_len": 32}, progress=False)
    with pytest.raises(GqakitError, match="takes no options"):
        convert_checkpoint(src, tmp_path / "out", 2, "mean", options={"seq_len": 32}, progress=False)
    assert not any(tmp_path.glob("*out*"))


def test_calibration_record_in_output(tiny_model, tmp_path, capsys):
    from gqakit.cli import main

    src = tiny_model("llama", num_key_value_heads=4)
    data = tmp_path / "calib.txt"
    data.write_text("abc def ghi jkl mno pqr stu vwx yz " * 200)
    main(["convert", str(src), str(tmp_path / "out"), "-g", "2", "--method", "align-refit", "--device", "cpu",
          "--calibration-data", str(data), "--calibration-tokens", "512", "--refit-option", "seq_len=64",
          "--refit-option", "holdout=0.25", "--refit-option", "steps=2"])
    out = capsys.readouterr()
    assert "residual drift" in out.out + out.err
    rec = json.loads((tmp_path / "out" / "gqakit_convert.json").read_text())
    cal = rec["calibration"]
    assert cal["options"]["seq_len"] == 64 and cal["options"]["holdout"] == 0.25
    assert cal["device"] == "cpu" and cal["tokens"] == cal["calibration_sequences"] * 64
    assert len(cal["residual_drift"]) == 1 and cal["peak_memory_bytes"] > 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "residual drift" in card and "expected quality" in card and "|h" not in card  # no pipes in the table
    assert "block-wise reconstruction: 2 Adam steps per layer" in card and len(cal["reconstruction"]) == 2
    assert not (tmp_path / "out" / ".scratch").exists()


@pytest.mark.parametrize("args, needle", [
    (["--device", "tpu9"], "--device must be auto, cpu, cuda, cuda:N or mps"),
    (["--refit-option", "seq_len"], "expects KEY=VALUE"),
    (["--refit-option", "bogus=1"], "unknown align-refit option"),
    (["--calibration-tokens", "0"], "at least 1"),
])
def test_convert_cli_refuses_bad_refit_input(tiny_model, tmp_path, capsys, args, needle):
    from gqakit.cli import main

    src = tiny_model("llama", num_key_value_heads=4)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["convert", str(src), str(tmp_path / "out"), "-g", "2", "--method", "align-refit", "-q", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", [{}, {"steps": 6, "lr": 1e-2}], ids=["closed-form", "reconstruction"])
def test_killed_run_resumes_after_its_last_saved_state(tiny_model, tmp_path, monkeypatch, capfd, one_thread, extra):
    """A run interrupted at layer 2 of 4 leaves no OUT, keeps its work in the partial folder,
    and the same command resumes there: layers 0-1 are not recomputed, and the result is
    bit-identical to an uninterrupted run."""
    from safetensors.torch import load_file

    from gqakit.convert.calibration.skeleton import Skeleton
    from gqakit.core.outdir import partial_dir

    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=4)
    kw = dict(calibration_tokens=256, options={"seq_len": 32, "save_seconds": 0, **extra}, progress=False,
              device="cpu")
    whole = convert_checkpoint(src, tmp_path / "whole", 1, "align-refit", **kw)

    loaded = []
    real = Skeleton.load_block
    kill = {"at": 2}

    def load_block(self, L):
        loaded.append(L)
        if kill and L == kill["at"]:
            kill.clear()
            raise KeyboardInterrupt
        return real(self, L)

    monkeypatch.setattr(Skeleton, "load_block", load_block)
    out = tmp_path / "out"
    with pytest.raises(Interrupted, match="re-run the same command to resume"):  # Ctrl-C, once a layer is kept
        convert_checkpoint(src, out, 1, "align-refit", **kw)
    assert not out.exists() and partial_dir(out).is_dir()
    assert list(dict.fromkeys(loaded)) == [0, 1, 2]  # (each block is read twice: before and after its fit)
    loaded.clear()
    capfd.readouterr()
    convert_checkpoint(src, out, 1, "align-refit", **{**kw, "progress": True})
    assert list(dict.fromkeys(loaded)) == [2, 3] and not partial_dir(out).exists()
    # a person reads layers counted from 1: two of four done, the third is next
    err = capfd.readouterr().err
    assert "after layer 2/4 (next: layer 3/4)" in err and "calibrating layer 3/4" in err, err
    assert "calibrating layer 2/4" not in err and "after layer 1" not in err, err
    a, b = load_file(out / "model.safetensors"), load_file(whole / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rec = json.loads((out / "gqakit_convert.json").read_text())["calibration"]
    ref = json.loads((whole / "gqakit_convert.json").read_text())["calibration"]
    assert rec["resumed_at_layer"] == 2 and rec["residual_drift"] == ref["residual_drift"]
    assert not any(p.name.startswith(".") and p.name != ".gqakit-output.json" for p in out.iterdir())


def test_partial_folder_without_a_resume_state_restarts_from_the_first_layer(tiny_model, tmp_path, monkeypatch,
                                                                              one_thread):
    """The resume state lives in `.resume/state`; a partial folder of the same command that
    holds anything else there (an older layout's `.resume/checkpoint`) is not read: the run
    starts over from layer 1, overwrites the shards in place and writes what an uninterrupted
    run writes, leaving no partial folder."""
    from safetensors.torch import load_file

    from gqakit.convert.calibration.skeleton import Skeleton
    from gqakit.core.outdir import RESUME_DIR, partial_dir

    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=4)
    kw = dict(calibration_tokens=256, options={"seq_len": 32, "save_seconds": 0}, progress=False, device="cpu")
    whole = convert_checkpoint(src, tmp_path / "whole", 1, "align-refit", **kw)
    loaded, real = [], Skeleton.load_block
    kill = {"at": 2}

    def load_block(self, L):
        loaded.append(L)
        if kill and L == kill["at"]:
            kill.clear()
            raise KeyboardInterrupt
        return real(self, L)

    monkeypatch.setattr(Skeleton, "load_block", load_block)
    out = tmp_path / "out"
    with pytest.raises(Interrupted):
        convert_checkpoint(src, out, 1, "align-refit", **kw)
    resume = partial_dir(out) / RESUME_DIR
    assert (resume / "state" / "state.json").is_file()
    (resume / "state").rename(resume / "checkpoint")
    loaded.clear()
    convert_checkpoint(src, out, 1, "align-refit", **kw)
    assert list(dict.fromkeys(loaded)) == [0, 1, 2, 3] and not partial_dir(out).exists()
    a, b = load_file(out / "model.safetensors"), load_file(whole / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "gqakit_convert.json").read_text())["calibration"]["resumed_at_layer"] is None
    assert not any(p.name.startswith(".") and p.name != ".gqakit-output.json" for p in out.iterdir())


def test_partial_folder_of_another_command_is_replaced_and_foreign_one_refused(tiny_model, tmp_path):
    from gqakit.core.outdir import partial_dir

    src = tiny_model("llama", num_key_value_heads=4)
    out = tmp_path / "out"
    part = partial_dir(out)
    part.mkdir()
    (part / "mine.txt").write_text("not gqakit's")
    with pytest.raises(GqakitError, match="was not left by gqakit"):
        convert_checkpoint(src, out, 2, "align-refit", calibration_tokens=128, options={"seq_len": 32},
                           progress=False)
    assert (part / "mine.txt").read_text() == "not gqakit's"
    (part / "mine.txt").unlink()
    (part / "gqakit_partial.json").write_text(json.dumps({"fingerprint": "other", "pid": 0}))
    convert_checkpoint(src, out, 2, "align-refit", calibration_tokens=128, options={"seq_len": 32}, progress=False)
    assert out.is_dir() and not part.exists()


def test_failure_before_any_saved_state_leaves_nothing(tiny_model, tmp_path):
    from gqakit.core.outdir import partial_dir

    src = tiny_model("llama", num_key_value_heads=4)
    data = tmp_path / "short.txt"
    data.write_text("abc")
    with pytest.raises(GqakitError, match="fewer than one sequence"):
        convert_checkpoint(src, tmp_path / "out", 2, "align-refit", calibration_data=str(data),
                           options={"seq_len": 32}, progress=False)
    assert not (tmp_path / "out").exists() and not partial_dir(tmp_path / "out").exists()


def test_calibration_from_a_local_datasets_source(tiny_model, tmp_path, monkeypatch):
    """--calibration-data hf:NAME[:CONFIG][:SPLIT], read offline (here: a local folder of text files)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "a.txt").write_text("abc def ghi jkl mno pqr stu vwx yz\n" * 300)
    src = tiny_model("llama", num_key_value_heads=4)
    out = convert_checkpoint(src, tmp_path / "out", 2, "align-refit", calibration_data=f"hf:{ds}::train",
                             calibration_tokens=256, options={"seq_len": 32}, progress=False)
    cal = json.loads((out / "gqakit_convert.json").read_text())["calibration"]
    assert cal["calibration"].startswith(f"hf:{ds}::train") and cal["tokens"] == 256
    with pytest.raises(GqakitError, match="cannot load dataset"):
        convert_checkpoint(src, tmp_path / "out2", 2, "align-refit", calibration_data="hf:no-such-dataset-here",
                           options={"seq_len": 32}, progress=False)
    assert not (tmp_path / "out2").exists()


def test_sampling_that_cannot_fit_asks_for_calibration_data(tiny_model, tmp_path, monkeypatch):
    from gqakit.convert.calibration import tokens

    monkeypatch.setattr(tokens, "available_memory", lambda device: 1000)
    src = tiny_model("llama", num_key_value_heads=4)
    with pytest.raises(GqakitError, match="needs the whole model in memory.*pass --calibration-data"):
        convert_checkpoint(src, tmp_path / "out", 2, "align-refit", options={"seq_len": 32}, progress=False)
    assert not list(tmp_path.glob("*out*"))


def test_blockwise_reconstruction_lowers_the_drift(tiny_model, one_thread):
    """`steps` Adam steps per layer on the converted attention weights: each layer's
    reconstruction loss on the measured rows ends below the closed-form start, the final
    residual drift is lower, and only attention tensors change."""
    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=3)
    base = {"seq_len": 32, "batch": 4, "holdout": 0.25}
    kw = dict(source=src, num_kv_heads=1, method="align-refit", calibration_tokens=1024, grouping="contiguous")
    settings = ConvertSettings(**kw, effort="fast", refit=base)
    closed, s0, _, _ = _streamed(src, settings)
    settings = ConvertSettings(**kw, refit={**base, "steps": 40, "lr": 1e-2, "guard_spans": 2, "train": "attention"})
    trained, s1, _, plan = _streamed(src, settings)
    rec = s1["reconstruction"]
    assert [r["layer"] for r in rec] == list(range(plan.shape.num_layers))
    assert all(r["best_step"] > 0 for r in rec), rec  # the guard kept trained weights in every layer
    assert s1["residual_drift"][-1] < s0["residual_drift"][-1]
    assert "reconstruction" not in s0
    for L in closed:
        assert not torch.equal(trained[L].o, closed[L].o)
        assert trained[L].k.shape == closed[L].k.shape


def test_reconstruction_is_skipped_when_nothing_is_pooled(tiny_model, one_thread):
    src = tiny_model("llama", num_key_value_heads=4)
    settings = ConvertSettings(source=src, num_kv_heads=4, method="align-refit", force=True,
                               calibration_tokens=256, refit={"seq_len": 32, "steps": 5})
    got, summary, opened, plan = _streamed(src, settings)
    assert "reconstruction" not in summary
    plain, _, _, _ = _streamed(src, ConvertSettings(source=src, num_kv_heads=4, method="align-refit", force=True,
                                                    calibration_tokens=256,
                                                    refit={"seq_len": 32}))
    _assert_same_heads(got, plain, rtol=0, atol=0)


def test_block_training_writes_the_trained_mlp_and_norms(tiny_model, one_thread, tmp_path):
    """`train=block`: the reconstruction steps train every weight of each block; the output
    holds the trained MLP and norms (loaded by stock transformers), everything outside the
    blocks stays the source's, and the drift ends below the closed form's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=3)
    base = {"seq_len": 32, "batch": 4, "holdout": 0.25, "lr": 1e-2, "guard_spans": 2}
    kw = dict(calibration_tokens=1024, progress=False, grouping="contiguous")
    closed = convert_checkpoint(src, tmp_path / "closed", 1, "align-refit", options={"seq_len": 32, "batch": 4,
                                                                                     "holdout": 0.25}, effort="fast",
                                **kw)
    attn = convert_checkpoint(src, tmp_path / "attn", 1, "align-refit",
                              options={**base, "steps": 30, "train": "attention"}, **kw)
    block = convert_checkpoint(src, tmp_path / "block", 1, "align-refit",
                               options={**base, "steps": 30, "train": "block"}, **kw)
    orig = load_file(src / "model.safetensors")
    got = {d: load_file(d / "model.safetensors") for d in (attn, block)}
    mlp = [n for n in orig if ".mlp." in n or "layernorm" in n]
    outside = [n for n in orig if not n.startswith("model.layers.")]
    assert mlp and outside
    assert all(torch.equal(got[attn][n], orig[n]) for n in mlp + outside)
    assert all(torch.equal(got[block][n], orig[n]) for n in outside)
    assert sum(not torch.equal(got[block][n], orig[n]) for n in mlp) == len(mlp)
    drift = {d: json.loads((d / "gqakit_convert.json").read_text())["calibration"]["residual_drift"][-1]
             for d in (closed, block)}
    assert drift[block] < drift[closed]
    card = (block / "README.md").read_text()
    assert "every weight of the block" in card
    model = AutoModelForCausalLM.from_pretrained(block).eval()
    assert model.config.num_key_value_heads == 1
    assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all()


def test_block_training_is_refused_for_gguf_output(tmp_path):
    from gqakit.convert import convert_gguf

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    with pytest.raises(GqakitError, match="train=block .* convert to a model folder"):
        convert_gguf(src, tmp_path / "out.gguf", 1, "align-refit", options={"steps": 4, "train": "block"},
                     progress=False)
    assert not (tmp_path / "out.gguf").exists()
    # without steps train=block does nothing, so it is no reason to refuse (the fake source is)
    with pytest.raises(GqakitError) as err:
        convert_gguf(src, tmp_path / "out.gguf", 1, "align-refit", options={"steps": 0, "train": "block"},
                     progress=False)
    assert "train=block" not in str(err.value)
    assert not (tmp_path / "out.gguf").exists()
    with pytest.raises(GqakitError, match="align-refit option train='blocks'; choose from auto, attention, block"):
        RefitOptions.parse({"train": "blocks"})


def test_which_conversions_train_whole_blocks():
    block = RefitOptions.parse({"steps": 5, "train": "block"})
    assert block.train_steps(4, 2) == 5 and block.trains_block(4, 2)
    assert block.train_steps(4, 4) == 0 and not block.trains_block(4, 4)  # exact: no steps
    assert block.trains_block()  # head counts not known yet: the steps asked for
    assert not RefitOptions.parse({"steps": 0, "train": "block"}).trains_block(4, 2)
    assert not RefitOptions.parse({"steps": 5}).trains_block(4, 2)


def test_a_new_calibrated_method_is_a_new_fit(tiny_model, one_thread):
    """The stage drives any `Fit`: one that pools each group by its mean, without looking at
    the data, yields exactly the `mean` method's heads. The stage advances the original
    stream when the fit leaves it alone, to the same values as a fit that advances it."""
    from gqakit.convert.calibration.block import BlockContext, Fitted
    from gqakit.convert.layout import read_heads
    from gqakit.convert.pipeline import per_layer_heads
    from gqakit.convert.pooling import pool_contiguous

    class MeanFit:
        def __init__(self, advance: bool):
            self.advance, self.seen = advance, []

        def units(self, n_spans, layer):
            return n_spans if self.advance else 0

        def steps(self, layer):
            return 0

        def fit(self, ctx: BlockContext) -> Fitted:
            self.seen.append(ctx.layer)
            if self.advance:  # the original block on the original stream, as align-refit's o_proj pass does
                with torch.inference_mode():
                    for sl in ctx.spans:
                        ctx.advance_original(sl, ctx.block.run(sl, "orig"))
            heads = read_heads(ctx.spec, ctx.shape, ctx.block.source_attention(), ctx.layer, dtype=torch.float64)
            pooled = pool_contiguous(heads, ctx.num_kv_heads, "mean")
            return Fitted(pooled, ctx.block.weights(pooled))

        def record(self):
            return {"fit": "mean"}

        def describe(self, calibration):
            return f"mean pooling, drift {calibration['residual_drift'][-1]:.3f}"

    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=3)
    settings = ConvertSettings(source=src, num_kv_heads=2, method="align-refit", calibration_tokens=256,
                               refit={"seq_len": 32})
    opened = open_model(src)
    plan = make_plan(opened, settings)
    mean_plan = make_plan(opened, ConvertSettings(source=src, num_kv_heads=2, method="mean"))
    mean = dict(per_layer_heads(opened, mean_plan, mean_plan.settings))
    drifts = []
    for advance in (False, True):
        fit = MeanFit(advance)
        stage = CalibrationStage(opened, plan, plan.settings, fit, device="cpu", progress=False)
        got = dict(stage.layers())
        assert fit.seen == [0, 1, 2] and stage.summary["fit"] == "mean"
        assert stage.describe().startswith("mean pooling, drift")
        for L in mean:
            for part in ("k", "v"):
                torch.testing.assert_close(getattr(got[L], part), getattr(mean[L], part).to(torch.float64))
        drifts.append(stage.summary["residual_drift"])
    assert len(drifts[0]) == 2 and all(d > 0 for d in drifts[0]) and drifts[0] == drifts[1]

