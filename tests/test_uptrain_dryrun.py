"""`gqakit uptrain --dry-run` makes every check a run makes before its first step and
reports every problem at once; it exits 0 only when the run would start."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TEXTS = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40 + i % 9)) for i in range(60)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(the pico llama, its G=2 conversion), shared by the module: the checks only read them."""
    from gqakit.convert import convert_checkpoint
    from tiny_models import build

    tmp = tmp_path_factory.mktemp("models")
    mha = build("llama", tmp / "mha", num_attention_heads=8, num_key_value_heads=8)
    return mha, convert_checkpoint(mha, tmp / "g2", 2, method="mean", progress=False)


def config(model: Path, out: Path, **train) -> dict:
    return {"model": {"path": str(model)}, "data": {"texts": TEXTS},
            "train": {"tokens": 16 * 2 * 3, "seq_len": 16, "micro_batch": 2, "precision": "fp32", **train},
            "output": {"dir": str(out)}, "logging": {"every": 1, "tensorboard": False}}


def dry_run(cfg: dict, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(path), *args, "--dry-run"],
                          capture_output=True, text=True, cwd=tmp_path)


def errors(r: subprocess.CompletedProcess) -> list[str]:
    lines = r.stderr.splitlines()
    assert all(ln.startswith("gqakit: error: ") for ln in lines), r.stderr
    return [ln[len("gqakit: error: "):] for ln in lines]


def test_a_run_that_would_start_exits_0_with_its_schedule(models, tmp_path: Path):
    _, g2 = models
    r = dry_run(config(g2, tmp_path / "run", warmup_steps=1), tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "# schedule: 3 steps of 32 tokens (1 process), warm-up 1 step to lr 0.0003, then cosine to 3e-05" \
        in r.stdout.splitlines()
    assert "# memory plan per process" in r.stdout and not (tmp_path / "run").exists()


def test_every_problem_is_reported_at_once(models, tmp_path: Path):
    mha, g2 = models
    cfg = config(g2, g2 / "run", tokens=10)  # the run folder inside the model; a budget under one step
    cfg["teacher"] = {"path": str(tmp_path / "no-teacher"), "kl_weight": 1.0}
    cfg["data"] = {"files": [str(tmp_path / "missing-*.txt")]}
    r = dry_run(cfg, tmp_path)
    assert r.returncode == 2
    got = errors(r)
    assert len(got) == 4, got
    assert got[0].startswith("teacher.path: ") and str(tmp_path / "no-teacher") in got[0]
    assert got[1] == f"data.files: no file matches '{tmp_path / 'missing-*.txt'}'"
    assert got[2].startswith("output.dir") and str(g2) in got[2]
    assert got[3] == "train.tokens: 10 is less than one optimizer step (32 tokens)"
    assert "# memory plan: none; teacher.path was refused" in r.stdout
    yaml.safe_load(r.stdout)  # still the resolved config, with comments


def test_the_tokenizer_is_loaded_and_matched_with_the_teacher(models, tmp_path: Path):
    mha, g2 = models
    no_tok = tmp_path / "g2-no-tokenizer"
    shutil.copytree(g2, no_tok)
    for f in no_tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    r = dry_run(config(no_tok, tmp_path / "run"), tmp_path)
    assert r.returncode == 2 and len(errors(r)) == 1 and "tokenizer" in errors(r)[0], r.stderr
    assert "# memory plan per process" in r.stdout  # the other checks still ran

    other = tmp_path / "teacher"
    shutil.copytree(mha, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"]["zz-extra"] = len(tok["model"]["vocab"])
    (other / "tokenizer.json").write_text(json.dumps(tok))
    cfg = config(g2, tmp_path / "run")
    cfg["teacher"] = {"path": str(other), "kl_weight": 1.0}
    r = dry_run(cfg, tmp_path)
    assert r.returncode == 2 and errors(r) == [f"teacher.path: the tokenizer of {other} differs from the model's"]


def test_a_warm_up_longer_than_the_run_is_said_not_refused(models, tmp_path: Path):
    _, g2 = models
    r = dry_run(config(g2, tmp_path / "run", warmup_steps=20), tmp_path)
    assert r.returncode == 0, r.stderr
    assert ("# train.warmup_steps 20 is not shorter than the run's 3 optimizer steps; starting at the peak instead "
            "(a warm-up of 10% is under one step), so the lr reaches 0.0003 and the cosine decay runs") \
        in r.stdout.splitlines()


def test_an_earlier_run_folder_is_checked_as_a_run_would(models, tmp_path: Path):
    _, g2 = models
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = dry_run(config(g2, out), tmp_path)
    assert r.returncode == 2 and errors(r) == [f"output.dir {out} is not empty; pass --overwrite to replace it or "
                                               "--resume to continue"]
    r = dry_run(config(g2, out), tmp_path, "--overwrite")
    assert r.returncode == 2 and len(errors(r)) == 1 and "output.dir" in errors(r)[0]
    r = dry_run(config(g2, out), tmp_path, "--resume")
    assert r.returncode == 2 and errors(r)[0].startswith("--resume: no checkpoint")
    assert (out / "notes.txt").read_text() == "mine"
