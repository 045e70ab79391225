"""Resume after SIGKILL reproduces the one-go run; 2 CPU processes match 1 (accelerate, gloo)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from gqakit.core.loading import load_causal_lm
from gqakit.uptrain import run_uptrain

REPO = Path(__file__).resolve().parents[1]
TEXTS = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40 + i % 9)) for i in range(80)]


@pytest.fixture
def converted(tiny_model, tmp_path: Path) -> Path:
    from gqakit.convert import convert_checkpoint

    return convert_checkpoint(tiny_model("llama"), tmp_path / "g2", 2, progress=False)


@pytest.fixture
def converted_t5(tmp_path: Path) -> Path:
    """A pico T5 1.1 with its decoder's self- and cross-attention mean-pooled to 1 KV head."""
    from gqakit.convert import convert_checkpoint
    from tiny_models import build_seq2seq

    return convert_checkpoint(build_seq2seq("t5_v1_1", tmp_path / "t5"), tmp_path / "t5-g1", 1, method="mean",
                              progress=False)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from gqakit.core.loading import load_seq2seq_lm

    seq2seq = json.loads((folder / "config.json").read_text()).get("is_encoder_decoder")
    return (load_seq2seq_lm if seq2seq else load_causal_lm)(folder).state_dict()


def write_cfg(path: Path, model: Path, out: Path, steps: int, **train) -> Path:
    tree = {
        "model": {"path": str(model)},
        "data": {"texts": TEXTS},
        "train": {"tokens": steps * 2 * 16, "seq_len": 16, "micro_batch": 2, "lr": 2e-3, "warmup_steps": 5,
                  "precision": "fp32", "seed": 3, **train},
        "output": {"dir": str(out), "save_every": max(1, steps // 6), "keep_last": 2},
        "logging": {"every": 1, "tensorboard": False},
    }
    path.write_text(yaml.safe_dump(tree))
    return path


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("model, steps, train", [
    ("converted", 120, {}), pytest.param("converted", 2000, {}, marks=pytest.mark.slow),
    # LoRA adapters (peft) with dropout: the adapters, their Adam state and the dropout RNG resume exactly
    pytest.param("converted", 120, {"lora": {"r": 4, "dropout": 0.1}}, id="lora", marks=pytest.mark.slow),
    # an encoder-decoder: span corruption draws its spans from the seed and the block, so they resume too
    pytest.param("converted_t5", 120, {}, id="t5-span-corruption", marks=pytest.mark.slow),
])
def test_resume_after_sigkill_matches_one_go_run(model: str, request, tmp_path: Path, steps: int, train: dict):
    converted = request.getfixturevalue(model)
    # Both runs are subprocesses with the same thread count, so float results are comparable.
    go = write_cfg(tmp_path / "go.yaml", converted, tmp_path / "go", steps, **train)
    subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(go), "-q"], check=True, env=env(), cwd=tmp_path)

    cfg = write_cfg(tmp_path / "k.yaml", converted, tmp_path / "k", steps, **train)
    proc = subprocess.Popen([sys.executable, "-m", "gqakit", "uptrain", str(cfg), "-q"], env=env(), cwd=tmp_path)
    ckpts = tmp_path / "k" / "checkpoints"
    deadline = time.time() + 300
    # Kill once the second checkpoint is on disk: mid-run, with steps after it to redo.
    while time.time() < deadline and len([p for p in ckpts.glob("step-*")]) < 2 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (tmp_path / "k" / "model").exists()
    killed_at = max(s for s, _ in losses(tmp_path / "k"))
    assert killed_at < steps

    r = subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(cfg), "-q", "--resume"], env=env(), cwd=tmp_path)
    assert r.returncode == 0
    a, b = losses(tmp_path / "go"), losses(tmp_path / "k")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, steps + 1))  # no step logged twice
    torch.testing.assert_close(torch.tensor([l for _, l in b]), torch.tensor([l for _, l in a]), rtol=1e-6, atol=1e-6)
    wa, wb = weights(tmp_path / "go" / "model"), weights(tmp_path / "k" / "model")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-6)


def test_two_cpu_processes_match_one(converted: Path, tmp_path: Path):
    """Two CPU processes through accelerate (torchrun + gloo), same global batch and seed.

    accelerate 1.15's `launch --cpu` starts a single process unless MPI is configured, so
    the two processes come from `--multi_gpu`; with no GPU, uptrain runs them on gloo.
    """
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    steps = 12
    one = write_cfg(tmp_path / "one.yaml", converted, tmp_path / "one", steps, micro_batch=2, grad_accum=2,
                    tokens=steps * 4 * 16)
    two = write_cfg(tmp_path / "two.yaml", converted, tmp_path / "two", steps, micro_batch=2, grad_accum=1,
                    tokens=steps * 4 * 16)
    subprocess.run([sys.executable, "-m", "gqakit", "uptrain", str(one), "-q"], check=True, env=env(), cwd=tmp_path)
    two_args = [str(two)]  # not -q: the plan line shows the world size
    r = subprocess.run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                        "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "gqakit", "uptrain", *two_args],
                       env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on 2 x cpu" in r.stdout + r.stderr
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, steps + 1))
    # Same blocks per step; only the order of float sums differs (gloo all-reduce).
    torch.testing.assert_close(torch.tensor([l for _, l in b]), torch.tensor([l for _, l in a]), rtol=1e-4, atol=1e-5)
    wa = load_causal_lm(tmp_path / "one" / "model").state_dict()
    wb = load_causal_lm(tmp_path / "two" / "model").state_dict()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-4)
