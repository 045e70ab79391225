"""Hostile input to every verb: one clear line, the right exit code, and nothing lost.

Every case runs the CLI in-process (`gqakit.cli.main`) inside its own tmp tree that
holds copies of the inputs: a converted pico model, training and evaluation text, a
finished uptrain run, earlier eval results and a report. Each case asserts three things:
  - the exit code (2 for a refused input);
  - stderr is exactly one `gqakit: error: ...` line, with no traceback;
  - every file in the tmp tree is byte-identical afterwards (sha256 of each file), and
    no new file or folder appeared (a failed run leaves nothing behind).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from gqakit.cli import main

# Pico tokenizer: single characters 33..93 separated by whitespace.
TEXTS = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40 + i % 9)) for i in range(60)]
EVAL = [" ".join(chr(33 + (i * 5 + j) % 61) for j in range(50)) for i in range(8)]


# ----------------------------------------------------------------------------- helpers


def run_cli(args: list, capfd) -> tuple[int, str, str]:
    """Run `gqakit ARGS` in-process; (exit code, stdout, stderr) as the terminal sees them."""
    capfd.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capfd.readouterr()
    return code, out, err


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ROOT, and every folder (so new empty folders show too)."""
    snap = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_file():
            snap[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            snap[rel + "/"] = "dir"
    return snap


def assert_refused(code: int, err: str, *needles: str, exit_code: int = 2) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("gqakit: error: "), lines[0]
    assert "internal error" not in lines[0], lines[0]
    assert code == exit_code, (code, lines[0])
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def refused(root: Path, args: list, capfd, *needles: str, exit_code: int = 2) -> str:
    """Run ARGS; assert a one-line refusal and that nothing under ROOT changed."""
    before = snapshot(root)
    code, _, err = run_cli(args, capfd)
    line = assert_refused(code, err, *needles, exit_code=exit_code)
    after = snapshot(root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"files changed, appeared or vanished: {changed[:10]}"
    return line


# ----------------------------------------------------------------------------- assets


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """Built once per module: models, text, a finished run, results and a report."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import build

    from gqakit.convert import convert_checkpoint
    from gqakit.eval.report import write_report
    from gqakit.eval.perplexity import PerplexitySettings, Window
    from gqakit.eval.runner import run_eval
    from gqakit.uptrain import run_uptrain

    root = tmp_path_factory.mktemp("assets")
    mha = build("llama", root / "mha", num_key_value_heads=8)
    g2 = convert_checkpoint(mha, root / "g2", 2, progress=False)
    data = root / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n\n".join(TEXTS))
    (data / "eval.txt").write_text("\n\n".join(EVAL))
    cache = tmp_path_factory.mktemp("cache")  # tokenized data: outside every hashed tree
    cfg = uptrain_tree(g2, data / "train.txt", root / "run", cache)
    cfg["output"]["save_every"] = 2
    run_uptrain(cfg, quiet=True)
    rep = root / "rep"
    for name, model in (("a", mha), ("b", g2)):
        run_eval(model, perplexity=PerplexitySettings(data=data / "eval.txt", window=Window(context=16)),
                 out=rep / f"{name}.json", progress=False)
    write_report([rep / "a.json", rep / "b.json"], root / "report", command=["test"])
    (root / "cache").symlink_to(cache)
    return root


def uptrain_tree(model: Path, train: Path, out: Path, cache: Path, **train_kw) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"files": [str(train)], "cache_dir": str(cache)},
        "train": {"tokens": 16 * 2 * 4, "seq_len": 16, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 1,
                  "precision": "fp32", **train_kw},
        "output": {"dir": str(out), "save_every": 0},
        "logging": {"every": 1, "tensorboard": False},
    }


@pytest.fixture
def world(assets: Path, tmp_path: Path) -> Path:
    """A fresh copy of the assets in this test's own tmp tree (the cache stays outside)."""
    root = tmp_path / "w"
    root.mkdir()
    for name in ("mha", "g2", "data", "run", "rep", "report"):
        shutil.copytree(assets / name, root / name, symlinks=True)
    return root


def cache_of(assets: Path) -> Path:
    return (assets / "cache").resolve()


def write_cfg(world: Path, assets: Path, name: str = "cfg.yaml", *, out: Path | None = None, **train_kw) -> Path:
    """A valid uptrain config in WORLD/name (training on data/train.txt, output WORLD/run)."""
    tree = uptrain_tree(world / "g2", world / "data" / "train.txt", out or world / "run", cache_of(assets), **train_kw)
    p = world / name
    p.write_text(yaml.safe_dump(tree))
    return p


# ============================================================================ data loss
# Each of these destroyed the user's files before issue 11.


def test_uptrain_overwrite_checks_everything_before_deleting(world, assets, capfd):
    cfg = write_cfg(world, assets)
    refused(world, ["uptrain", cfg, "train.seq_len=4096", "--overwrite"], capfd, "train.seq_len", "4096")
    refused(world, ["uptrain", cfg, f"data.files=[{world}/data/nothing*.txt]", "--overwrite"], capfd,
            "data.files", "no file matches")


def test_uptrain_output_dir_holding_the_training_file(world, assets, capfd):
    cfg = write_cfg(world, assets, out=world / "data")
    refused(world, ["uptrain", cfg, "--overwrite"], capfd, "output.dir", "train.txt")


def test_eval_out_is_the_data_file(world, capfd):
    data = world / "data" / "eval.txt"
    refused(world, ["eval", world / "g2", "--data", data, "--context", 16, "--out", data], capfd, "--out", "eval.txt")
    refused(world, ["eval", world / "g2", "--data", data, "--context", 16, "--out", data, "--overwrite"], capfd,
            "--out", "eval.txt")


def test_eval_out_inside_the_model(world, capfd):
    data = world / "data" / "eval.txt"
    for extra in ([], ["--overwrite"]):
        refused(world, ["eval", world / "g2", "--data", data, "--context", 16, "--out", world / "g2" / "config.json",
                        *extra], capfd, "--out", "g2")


def test_eval_out_existing_result_needs_overwrite(world, capfd):
    data = world / "data" / "eval.txt"
    refused(world, ["eval", world / "g2", "--data", data, "--context", 16, "--out", world / "rep" / "a.json"], capfd,
            "already exists", "--overwrite")


def test_compare_out_holding_its_inputs(world, capfd):
    rep = world / "rep"
    refused(world, ["compare", rep / "a.json", rep / "b.json", "--out", rep, "--overwrite"], capfd, "--out", "a.json")
    refused(world, ["compare", rep / "a.json", rep / "b.json", "--out", rep / "a.json", "--overwrite"], capfd, "a.json")


# ============================================================================ uptrain: NaN


def test_divergence_never_writes_a_nan_checkpoint(world, assets, capfd):
    """lr=1e8 (the issue's case: step 2's loss is finite, its update is not): the error names a checkpoint that really is good."""
    import torch
    from safetensors.torch import load_file

    run = world / "nan"
    cfg = write_cfg(world, assets, out=run, tokens=16 * 2 * 30)
    code, _, err = run_cli(["uptrain", cfg, "train.lr=1e8", "output.save_every=1", "train.warmup_steps=0", "-q"], capfd)
    line = assert_refused(code, err, "training diverged at step", "the last good checkpoint is")
    named = Path(line.split("the last good checkpoint is ")[1].split(")")[0])
    assert named.is_dir() and not (run / "model").exists()
    for ckpt in (run / "checkpoints").glob("step-*"):
        for name, t in load_file(ckpt / "model.safetensors").items():
            assert torch.isfinite(t).all(), (ckpt.name, name)
    # The named checkpoint is the newest one, and its weights give a finite loss.
    assert named == max((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    from gqakit.core.loading import load_causal_lm

    model = load_causal_lm(world / "g2")
    model.load_state_dict(load_file(named / "model.safetensors"), strict=False)
    x = torch.tensor([[33 + (j * 3) % 61 for j in range(16)]]) - 30
    assert torch.isfinite(model(input_ids=x, labels=x).loss)


# ============================================================================ uptrain: resume


def test_resume_damaged_checkpoint_names_the_file_and_an_intact_one(world, assets, capfd):
    cfg = write_cfg(world, assets, tokens=16 * 2 * 6)
    for name, damage in (("optimizer.bin", lambda b: b[: len(b) // 2]),
                         ("model.safetensors", lambda b: b[:100]),
                         ("trainer_state.json", lambda b: b"\x00\xff garbage")):
        f = world / "run" / "checkpoints" / "step-4" / name
        good = f.read_bytes()
        f.write_bytes(damage(good))
        refused(world, ["uptrain", cfg, "--resume", "-q"], capfd, "step-4 is damaged", name, "step-2 is intact")
        f.write_bytes(good)


def test_resume_with_different_data_files_is_refused(world, assets, capfd):
    other = world / "data" / "other.txt"
    other.write_text("\n\n".join(TEXTS[::-1]))
    cfg = write_cfg(world, assets, tokens=16 * 2 * 6)
    refused(world, ["uptrain", cfg, f"data.files=[{other}]", "--resume", "-q"], capfd, "--resume",
            "training data differ", "data.files")
    # Same path, new content: the tokens' fingerprint catches it.
    (world / "data" / "train.txt").write_text("\n\n".join(TEXTS[::-1]))
    refused(world, ["uptrain", cfg, "--resume", "-q"], capfd, "--resume", "training data differ")


def test_failed_checkpoint_write_says_disk_and_path(world, assets, capfd, monkeypatch):
    import errno

    import accelerate

    def full(self, output_dir=None, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", output_dir)

    monkeypatch.setattr(accelerate.Accelerator, "save_state", full)
    cfg = write_cfg(world, assets, out=world / "new")
    code, _, err = run_cli(["uptrain", cfg, "output.save_every=2", "-q"], capfd)
    assert_refused(code, err, "no space left", "disk full or over quota", str(world / "new" / "checkpoints"))
    assert not list((world / "new" / "checkpoints").glob(".step-*")), "a half-written checkpoint was left behind"


def test_interrupt_says_how_to_resume(world, assets, capfd, monkeypatch):
    from gqakit.uptrain import trainer

    real = trainer.save_checkpoint
    calls = []

    def save_then_ctrl_c(*a, **kw):
        real(*a, **kw)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_ctrl_c)
    cfg = write_cfg(world, assets, out=world / "new", tokens=16 * 2 * 8)
    code, _, err = run_cli(["uptrain", cfg, "output.save_every=2", "-q"], capfd)
    assert code == 130 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gqakit: interrupted: "), err
    assert "step-4" in lines[0] and f"gqakit uptrain {cfg} output.save_every=2 --resume" in lines[0]


# ============================================================================ damaged files: one line naming the file


def _garbage_gguf(path: Path) -> Path:
    """A GGUF header that parses (magic, version 3, counts), then random bytes."""
    import os
    import struct

    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 5, 7) + os.urandom(4000))
    return path


def test_eval_corrupt_or_truncated_safetensors(world, capfd):
    f = world / "g2" / "model.safetensors"
    good = f.read_bytes()
    data = world / "data" / "eval.txt"
    for bad in (good[: len(good) // 2], good[:6], b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + good[24:]):
        f.write_bytes(bad)
        refused(world, ["eval", world / "g2", "--data", data, "--context", 16, "--out", world / "new" / "r.json", "-q"],
                capfd, "model.safetensors", "truncated or corrupt")
    f.write_bytes(good)


@pytest.mark.parametrize("content, needle", [
    (b"\x8f\x00\xff\xfe random \x00 bytes \xc3\x28", "config.json"),
    (b"[1, 2, 3]", "not a list"),
    (None, "num_attention_heads must be a positive integer, got 0"),
    (b'{"num_attention_heads": "8", "architectures": ["LlamaForCausalLM"]}', "num_attention_heads"),
])
def test_broken_config_json_in_every_verb(world, assets, capfd, content, needle):
    cfg_file = world / "g2" / "config.json"
    if content is None:
        content = json.dumps({**json.loads(cfg_file.read_text()), "num_attention_heads": 0}).encode()
    cfg_file.write_bytes(content)
    data = world / "data" / "eval.txt"
    refused(world, ["eval", world / "g2", "--data", data, "--context", 16, "--out", world / "r.json", "-q"], capfd,
            "config.json", needle)
    refused(world, ["inspect", world / "g2"], capfd, "config.json", needle)
    refused(world, ["convert", world / "g2", world / "g1", "-g", 1, "-q"], capfd, "config.json", needle)
    refused(world, ["uptrain", write_cfg(world, assets, out=world / "new"), "-q"], capfd, "config.json", needle)


def test_random_bytes_config_files(world, capfd):
    import os

    cfg = world / "cfg.yaml"
    cfg.write_bytes(b"\xff\xfe\x00" + os.urandom(500))
    refused(world, ["uptrain", cfg, "-q"], capfd, "cfg.yaml", "not valid YAML")
    cfg.write_bytes(b"model: {path: [\x00\x01\x02}\n")
    refused(world, ["uptrain", cfg, "-q"], capfd, "cfg.yaml", "not valid YAML")
    refused(world, ["uptrain", world / "data" / "eval.txt", "-q"], capfd, "eval.txt", "mapping")


def test_gguf_with_valid_header_then_garbage(world, capfd):
    bad = _garbage_gguf(world / "bad.gguf")
    data = world / "data" / "eval.txt"
    for args in (["eval", bad, "--data", data, "--context", 16, "--out", world / "r.json", "-q"],
                 ["inspect", bad],
                 ["convert", bad, world / "out", "-g", 1, "-q"]):
        line = refused(world, args, capfd, "bad.gguf", "truncated or corrupt GGUF")
        assert "JSON" not in line


def test_eval_unknown_device(world, capfd):
    data = world / "data" / "eval.txt"
    refused(world, ["eval", world / "g2", "--data", data, "--device", "tpu9", "--out", world / "r.json"], capfd,
            "--device", "tpu9")
    refused(world, ["eval", world / "g2", "--data", data, "--device", "cuda:99", "--out", world / "r.json"], capfd,
            "--device", "cuda:99")


@pytest.mark.parametrize("edit, needle", [
    (lambda r: r["perplexity"].__setitem__("token_perplexity", "5.3"), "perplexity.token_perplexity"),
    (lambda r: r.__setitem__("model", None), "model"),
    (lambda r: r["model"].__setitem__("parameters", "many"), "model.parameters"),
    (lambda r: r.__setitem__("perplexity", None), "perplexity is null"),
    (lambda r: r["run"].pop("dtype"), "run.dtype"),
])
def test_compare_damaged_results(world, capfd, edit, needle):
    bad = json.loads((world / "rep" / "b.json").read_text())
    edit(bad)
    (world / "rep" / "bad.json").write_text(json.dumps(bad))
    refused(world, ["compare", world / "rep" / "a.json", world / "rep" / "bad.json", "--out", world / "new"], capfd,
            "bad.json", needle)


# ============================================================================ accepted silently before


@pytest.mark.parametrize("args, needle", [
    (["--stride", "0"], "--stride"),
    (["--stride", "-3"], "--stride"),
    (["--max-chars", "-10"], "--max-chars"),
    (["--max-chars", "0"], "--max-chars"),
    (["--context", "1"], "--context"),
])
def test_eval_bad_numbers(world, capfd, args, needle):
    data = world / "data" / "eval.txt"
    refused(world, ["eval", world / "g2", "--data", data, "--context", 16, *args, "--out", world / "r.json"], capfd,
            needle)


def test_uptrain_eval_file_with_the_content_of_a_training_file(world, assets, capfd):
    copy = world / "data" / "held-out.txt"
    copy.write_bytes((world / "data" / "train.txt").read_bytes())
    cfg = write_cfg(world, assets, out=world / "new")
    refused(world, ["uptrain", cfg, f"data.eval_file={copy}", "-q"], capfd, "data.eval_file", "same content",
            "train.txt")


@pytest.mark.parametrize("value", [".inf", "inf", "-.inf", ".nan", "1e400"])
def test_uptrain_non_finite_numbers_refused_at_validation(world, assets, capfd, value):
    cfg = write_cfg(world, assets, out=world / "new")
    refused(world, ["uptrain", cfg, f"train.lr={value}", "-q"], capfd, "train.lr")


def test_uptrain_bad_sizes_before_anything_is_written(world, assets, capfd):
    cfg = write_cfg(world, assets, out=world / "new" / "deeper")
    for override, needle in (("train.seq_len=4096", "train.seq_len"), ("train.tokens=10", "train.tokens"),
                             ("train.micro_batch=0", "train.micro_batch"),
                             (f"teacher.path={world}/nope", "teacher.path"),
                             (f"data.files=[{world}/data/*.md]", "no file matches")):
        refused(world, ["uptrain", cfg, override, "-q"], capfd, needle)


# ============================================================================ the output rule, everywhere


def test_output_rule_across_verbs(world, assets, capfd):
    data = world / "data"
    cfg = write_cfg(world, assets, out=world / "new")
    # uptrain: output.dir is the model, inside it, around the data, or holds the config file
    refused(world, ["uptrain", cfg, f"output.dir={world / 'g2'}", "--overwrite", "-q"], capfd, "is the model.path")
    refused(world, ["uptrain", cfg, f"output.dir={world / 'g2' / 'run'}", "-q"], capfd, "inside the model.path")
    refused(world, ["uptrain", cfg, f"output.dir={world}", "--overwrite", "-q"], capfd, "contains")
    # --overwrite of a folder gqakit did not write, or of another kind of gqakit output
    (world / "mine").mkdir()
    (world / "mine" / "notes.txt").write_text("mine")
    refused(world, ["uptrain", cfg, f"output.dir={world / 'mine'}", "--overwrite", "-q"], capfd, "not written by gqakit")
    refused(world, ["uptrain", cfg, f"output.dir={world / 'report'}", "--overwrite", "-q"], capfd, "compare report")
    (world / "run" / "notes.txt").write_text("added by hand")
    refused(world, ["uptrain", cfg, f"output.dir={world / 'run'}", "--overwrite", "-q"], capfd, "notes.txt",
            "did not write")
    (world / "run" / "notes.txt").unlink()
    # convert: OUT is the calibration text or holds it; an uptrain run is not a model folder
    refused(world, ["convert", world / "mha", data, "-g", 2, "--method", "align-refit", "--calibration-data",
                    data / "train.txt", "--overwrite", "-q"], capfd, "contains the calibration data")
    refused(world, ["convert", world / "mha", data / "train.txt", "-g", 2, "--method", "align-refit",
                    "--calibration-data", data / "train.txt", "--overwrite", "-q"], capfd, "is the calibration data")
    refused(world, ["convert", world / "mha", world / "run", "-g", 2, "--overwrite", "-q"], capfd, "uptrain run")
    # eval: --out is a folder, a file that is not a result, or inside the data folder's file
    refused(world, ["eval", world / "g2", "--data", data / "eval.txt", "--out", world / "report", "--overwrite"], capfd,
            "--out", "is a directory")
    refused(world, ["eval", world / "g2", "--data", data / "eval.txt", "--out", data / "train.txt", "--overwrite"], capfd,
            "not a gqakit results file")
    refused(world, ["eval", world / "g2", "--data", data / "eval.txt", "--out", world / "cfg.yaml", "--overwrite"], capfd,
            "not a gqakit results file")
    # compare: --out is a folder of the user's, or a model folder
    refused(world, ["compare", world / "rep" / "a.json", "--out", world / "mine", "--overwrite"], capfd,
            "not written by gqakit")
    refused(world, ["compare", world / "rep" / "a.json", "--out", world / "g2", "--overwrite"], capfd, "model folder")
    refused(world, ["compare", world / "rep" / "a.json", "--train-log", world / "run" / "log.jsonl",
                    "--out", world / "run", "--overwrite"], capfd, "contains the training log")
    # demo: --overwrite of a folder that is not an earlier demo
    refused(world, ["demo", "--out", world / "mine", "--overwrite"], capfd, "not written by gqakit")


def test_overwrite_replaces_gqakit_outputs(world, assets, capfd):
    """The other half of the rule: what gqakit wrote is replaced with --overwrite, and only that."""
    data = world / "data" / "eval.txt"
    code, _, err = run_cli(["eval", world / "g2", "--data", data, "--context", 16, "--out", world / "rep" / "a.json",
                            "--overwrite", "-q"], capfd)
    assert code == 0 and err == "", err
    assert json.loads((world / "rep" / "a.json").read_text())["model"]["kv_heads"] == 2
    code, _, err = run_cli(["compare", world / "rep" / "a.json", world / "rep" / "b.json", "--out", world / "report",
                            "--overwrite", "-q"], capfd)
    assert code == 0 and err == "", err
    code, _, err = run_cli(["uptrain", write_cfg(world, assets), "--overwrite", "-q"], capfd)
    assert code == 0 and err == "", err
    assert (world / "run" / "model" / "model.safetensors").is_file()


# ============================================================================ the terminal (real processes)

SCRIPT = r"""
import json, os, sys, time
from gqakit.cli import main

def run(tag, args):
    # each command's stderr goes to its own file, at the file-descriptor level
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.path.join(sys.argv[1], tag + ".err"), "wb") as f:
        os.dup2(f.fileno(), 2)
        t0 = time.perf_counter()
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = e.code or 0
        sys.stderr.flush()
        os.dup2(saved, 2)
    return {"code": code, "seconds": time.perf_counter() - t0, "torch": "torch" in sys.modules}

cmds = json.loads(sys.argv[2])
print(json.dumps({tag: run(tag, args) for tag, args in cmds}))
"""


def run_script(cmds: list, tmp: Path) -> tuple[dict, dict]:
    import os
    import subprocess
    import sys

    logs = tmp / "logs"
    logs.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(logs), json.dumps([[t, [str(a) for a in c]] for t, c in cmds])],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return res, {t: (logs / f"{t}.err").read_text() for t, _ in cmds}


def test_cheap_checks_answer_before_torch_is_imported(world, assets, tmp_path):
    """Paths, config and numbers are checked without importing torch (so they answer at once; how
    fast is a machine's property, not this test's)."""
    cfg = write_cfg(world, assets)
    data = world / "data" / "eval.txt"
    cmds = [("missing", ["uptrain", world / "missing.yaml"]),
            ("key", ["uptrain", cfg, "train.nope=1"]),
            ("seq", ["uptrain", cfg, "train.seq_len=4096", "--overwrite"]),
            ("lr", ["uptrain", cfg, "train.lr=.inf"]),
            ("stride", ["eval", world / "g2", "--data", data, "--stride", "0", "--out", world / "x.json"]),
            ("device", ["eval", world / "g2", "--data", data, "--device", "tpu9", "--out", world / "x.json"]),
            ("exists", ["eval", world / "g2", "--data", data, "--out", world / "rep" / "a.json"]),
            ("compare", ["compare", world / "rep" / "a.json", "--out", world / "rep", "--overwrite"]),
            ("inspect", ["inspect", _garbage_gguf(world / "bad.gguf")])]
    res, errs = run_script(cmds, tmp_path)
    for tag, _ in cmds:
        assert res[tag]["code"] == 2, (tag, errs[tag])
        assert len(errs[tag].strip().splitlines()) == 1, (tag, errs[tag])
    assert not any(res[tag]["torch"] for tag, _ in cmds), "a cheap check imported torch"


def test_quiet_means_nothing_on_stderr(world, assets, tmp_path):
    """-q: no loading bars, GGUF dequantisation bars or shared-tensor warnings; an error is one line."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_convert_gguf import write_gguf
    from tiny_models import build
    from transformers import AutoModelForCausalLM

    gguf = write_gguf(AutoModelForCausalLM.from_pretrained(world / "mha"), world / "mha.gguf")
    build("llama", world / "tied", num_key_value_heads=4, tie_word_embeddings=True)
    tree = uptrain_tree(world / "tied-g2", world / "data" / "train.txt", world / "tied-run", cache_of(assets))
    tree["output"]["save_every"] = 2  # accelerate warns about the tied (shared) tensor at every save
    tree["logging"]["tensorboard"] = True
    (world / "tied.yaml").write_text(yaml.safe_dump(tree))
    data = world / "data" / "eval.txt"
    cmds = [("convert_gguf", ["convert", gguf, world / "gguf-g2", "-g", 2, "-q"]),
            ("convert", ["convert", world / "tied", world / "tied-g2", "-g", 2, "-q"]),
            ("uptrain", ["uptrain", world / "tied.yaml", "-q"]),
            ("eval_gguf", ["eval", gguf, "--data", data, "--context", 16, "--out", world / "g.json", "-q"]),
            ("eval", ["eval", world / "tied-run" / "model", "--data", data, "--context", 16, "--speed", "--batch", 1,
                      "--prompt-len", 8, "--new-tokens", 2, "--reps", 1, "--out", world / "t.json", "-q"]),
            ("compare", ["compare", world / "g.json", world / "t.json", "--out", world / "cmp", "-q"]),
            ("error", ["eval", gguf, "--data", data, "--context", 100000, "--out", world / "e.json", "-q"]),
            ("loud", ["eval", gguf, "--data", data, "--context", 16, "--out", world / "loud.json"])]
    res, errs = run_script(cmds, tmp_path)
    for tag in ("convert_gguf", "convert", "uptrain", "eval_gguf", "eval", "compare"):
        assert res[tag]["code"] == 0 and errs[tag] == "", (tag, errs[tag])
    assert res["error"]["code"] == 2 and len(errs["error"].splitlines()) == 1, errs["error"]
    assert errs["error"].startswith("gqakit: error: --context 100000"), errs["error"]
    assert res["loud"]["code"] == 0 and errs["loud"] != "", "without -q the bars should show (the test must be able to fail)"
    assert (world / "tied-run" / "uptrain").is_dir(), "tensorboard logs in output.dir/uptrain"


def test_plan_says_cpu_and_help_names_the_tensorboard_folder(world, assets, capfd):
    code, out, err = run_cli(["uptrain", write_cfg(world, assets, out=world / "new", tokens=32)], capfd)
    assert code == 0, err
    plan = next(ln for ln in out.splitlines() if " x cpu" in ln)
    assert "(NO)" not in plan and "on 1 x cpu, fp32" in plan
    code, out, _ = run_cli(["uptrain", "--help"], capfd)
    assert code == 0 and "tensorboard" in out and "uptrain/" in out
    guide = (Path(__file__).resolve().parents[1] / "docs" / "uptrain.md").read_text()
    assert "tensorboard --logdir" in guide


def test_disk_full_leaves_no_folder_behind(world, capfd, monkeypatch):
    """A write that fails (disk full) is one line with the path, and removes what the run created."""
    import errno

    from gqakit.convert import io as convert_io
    from gqakit.core import outdir
    from gqakit.core.outrule import TMP_MARK

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert_io.ShardWriter, "finish", full)
    refused(world, ["convert", world / "mha", world / "new" / "deep" / "g4", "-g", 4, "-q"], capfd,
            "no space left", str(world / "new" / "deep" / "g4"))
    real = outdir.Path.write_text
    monkeypatch.setattr(outdir.Path, "write_text", lambda self, *a, **k: full() if TMP_MARK in self.name
                        else real(self, *a, **k))
    refused(world, ["eval", world / "g2", "--data", world / "data" / "eval.txt", "--context", 16,
                    "--out", world / "new" / "r.json", "-q"], capfd, "no space left", "r.json")


def test_resume_refuses_early_when_the_final_model_folder_is_not_gqakits(world, assets, capfd):
    (world / "run" / "model" / "my-notes.txt").write_text("mine")
    refused(world, ["uptrain", write_cfg(world, assets, tokens=16 * 2 * 6), "--resume", "-q"], capfd,
            "model", "my-notes.txt")


def test_eval_on_the_training_text_is_recorded(world, assets, capfd):
    """`eval --data` on text the uptrained model was trained on: warned, and recorded with the number."""
    train = world / "data" / "train.txt"
    model = world / "run" / "model"
    settings = yaml.safe_load((model / "gqakit_uptrain.yaml").read_text())
    settings["settings"]["data"]["files"] = [str(train)]  # the copy in this world
    (model / "gqakit_uptrain.yaml").write_text(yaml.safe_dump(settings))
    part = world / "part.txt"
    part.write_text(train.read_text()[:2000].rsplit("\n", 1)[0])  # a piece of it, not the whole file
    code, _, err = run_cli(["eval", model, "--data", part, "--context", 16, "--out", world / "r.json"], capfd)
    assert code == 0 and "trained on" in err, err
    seen = json.loads((world / "r.json").read_text())["perplexity"]["data"]["seen_in_training"]
    assert seen == [{"file": str(train.resolve()), "as": "uptrain data.files"}]
    code, _, err = run_cli(["eval", model, "--data", world / "data" / "eval.txt", "--context", 16,
                            "--out", world / "held.json", "-q"], capfd)
    assert code == 0 and err == "" and "seen_in_training" not in (world / "held.json").read_text()


def test_resume_from_the_runs_own_settings_file(world, capfd):
    """`gqakit uptrain RUN/gqakit_uptrain.yaml --resume`: the run's own record may sit in the run."""
    settings = world / "run" / "gqakit_uptrain.yaml"
    paths = [f"model.path={world / 'g2'}", f"data.files=[{world / 'data' / 'train.txt'}]",
             f"output.dir={world / 'run'}"]
    code, _, err = run_cli(["uptrain", settings, *paths, "train.tokens=192", "--resume", "-q"], capfd)
    assert code == 0 and err == "", err
    assert max(json.loads(r)["step"] for r in (world / "run" / "log.jsonl").read_text().splitlines()) == 6
    # but an --overwrite from it would delete it: refused
    refused(world, ["uptrain", settings, *paths, "--overwrite", "-q"], capfd, "contains the config file")


def test_gguf_without_the_gguf_package_says_so(world, capfd, monkeypatch):
    """An environment without the `gguf` package (a GPU image lacked it) gets that reason,
    not "corrupt file", and the GGUF is left as it was."""
    import sys

    from gqakit.core import loading

    bad = _garbage_gguf(world / "bad.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    loading._check_gguf.cache_clear()
    refused(world, ["inspect", bad], capfd, "bad.gguf", "needs the `gguf` package")
    loading._check_gguf.cache_clear()
