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
        run_eval(model, data=str(data / "eval.txt"), context=16, out=rep / f"{name}.json", progress=False)
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
    line = assert_refused(code, err, "no space left", "disk full or over quota", str(world / "new" / "checkpoints"))
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
