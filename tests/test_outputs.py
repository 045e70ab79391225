"""Every output folder is a complete model folder whose files follow the user's umask, and
what gqakit and the libraries print on stderr respects the terminal: nothing with -q, no
`\\r` redraws in a log file, no library message inside a progress bar."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import re
import stat
import struct
import subprocess
import sys
import termios
import warnings
from pathlib import Path

import pytest
import yaml

from gqakit.core.modelfiles import side_files
from gqakit.core.quiet import quiet_libraries
from gqakit.uptrain import run_uptrain
from tiny_models import build

TEXTS = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(40 + i % 9)) for i in range(60)]
EVAL = [" ".join(chr(33 + (i * 5 + j) % 61) for j in range(50)) for i in range(8)]


def recipe(model: Path, out: Path, texts: list[str] = TEXTS, eval_texts: list[str] = EVAL, steps: int = 4) -> dict:
    return {"model": {"path": str(model)}, "data": {"texts": texts, "eval_texts": eval_texts},
            "train": {"tokens": 16 * 2 * steps, "seq_len": 16, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 1,
                      "precision": "fp32"},
            "eval": {"every": 0}, "output": {"dir": str(out), "save_every": 2},
            "logging": {"every": 1, "tensorboard": False}}


def modes(root: Path) -> dict[str, int]:
    """The permission bits of ROOT's folders and files, by path relative to ROOT."""
    found = {}
    for folder, _, files in os.walk(root):
        for p in [Path(folder), *(Path(folder) / f for f in files)]:
            found[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return found


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_files_follow_the_umask(tmp_path: Path, mask: int, file_mode: int, dir_mode: int):
    """safetensors' save_file writes 0600 through a temporary file, and copy2 keeps a
    read-only source's 0444: every file of a convert and an uptrain output gets the mode
    the umask gives a new file instead."""
    from gqakit.convert import convert_checkpoint

    src = build("llama", tmp_path / "mha", tie_word_embeddings=True)
    for p in src.iterdir():
        p.chmod(0o444)  # a read-only source, as a shared model folder often is
    old = os.umask(mask)
    try:
        g2 = convert_checkpoint(src, tmp_path / "g2", 2, method="mean", progress=False)
        run_uptrain(recipe(g2, tmp_path / "run"), quiet=True)
    finally:
        os.umask(old)
    for out in (g2, tmp_path / "run"):
        got = modes(out)
        assert any(name.endswith("model.safetensors") for name in got)
        if out.name == "run":  # the model folder and the checkpoints
            assert "model/model.safetensors" in got and "checkpoints/step-4/model.safetensors" in got
        want = {name: dir_mode if (out / name).is_dir() else file_mode for name in got}
        assert got == want


def test_uptrained_folder_carries_the_converted_files_and_lineage(shared: Path, tmp_path: Path):
    """stories260K: the uptrained model/ holds the converted folder's tokenizer files
    (tokenizer.model included, which llama.cpp's converter reads) and generation settings
    byte for byte, its convert record, and a card and record of the whole lineage."""
    from gqakit.convert import convert_checkpoint

    src = shared / "models" / "stories260K"
    g2 = convert_checkpoint(src, tmp_path / "g2", 2, method="mean", progress=False)
    story = (shared / "data" / "tinystories" / "valid-excerpt.txt").read_text()
    texts = [t for t in story.split(". ") if len(t) > 40][:60]
    assert len(texts) == 60
    final = run_uptrain(recipe(g2, tmp_path / "run", texts[10:], texts[:10]), quiet=True)

    carried = [p.name for p in side_files(g2)]
    assert "tokenizer.model" in carried and "generation_config.json" in carried
    for name in carried:
        assert (final / name).read_bytes() == (g2 / name).read_bytes(), name
    assert (final / "gqakit_convert.json").read_bytes() == (g2 / "gqakit_convert.json").read_bytes()

    record = yaml.safe_load((final / "gqakit_uptrain.yaml").read_text())
    log = [json.loads(r) for r in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    held_out = [r["eval_loss"] for r in log if "eval_loss" in r][-1]
    source, conversion, uptraining = record["lineage"]
    assert source == {"step": "source", "model": str(src.resolve()), "family": "llama", "query heads": 8, "KV heads": 4}
    assert (conversion["step"], conversion["method"], conversion["G"], conversion["KV heads"], conversion["output"]) \
        == ("conversion", "mean", 2, "4 → 2", str(g2))
    assert (uptraining["step"], uptraining["from"], uptraining["optimizer steps"], uptraining["tokens"]) \
        == ("uptraining", str(g2), 4, "128")
    assert uptraining["final held-out loss"] == f"{held_out:.4f}"

    card = (final / "README.md").read_text()
    lineage = card.split("## Lineage", 1)[1]
    lines = [line for line in lineage.splitlines() if re.match(r"\d\. ", line)]
    assert [line.split("**")[1] for line in lines] == ["source", "conversion", "uptraining"]
    assert str(src.resolve()) in lines[0] and "method mean" in lines[1] and "KV heads 4 → 2" in lines[1]
    assert f"final held-out loss {held_out:.4f}" in lines[2] and "optimizer steps 4" in lines[2]

    # Uptrained again: the lineage grows by one step and the card keeps one Lineage section.
    again = run_uptrain(recipe(final, tmp_path / "run2", texts[10:], texts[:10], steps=2), quiet=True)
    steps = yaml.safe_load((again / "gqakit_uptrain.yaml").read_text())["lineage"]
    assert [s["step"] for s in steps] == ["source", "conversion", "uptraining", "uptraining"]
    assert steps[-1]["from"] == str(final)
    card = (again / "README.md").read_text()
    assert card.count("## Lineage") == 1 and card.rstrip().endswith("recipe gqakit_uptrain.yaml")
    assert (again / "tokenizer.model").read_bytes() == (g2 / "tokenizer.model").read_bytes()


# ----------------------------------------------------------------------------- stderr


def test_bars_are_lines_and_messages_whole_lines_off_a_terminal(monkeypatch):
    """In-process: with stderr a file, a bar prints plain lines (its end, no '\\r'), and a
    library's log record and a Python warning each print as one whole line."""
    from tqdm import std, tqdm

    err = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", err)
    display = std.tqdm.display
    with quiet_libraries(False, hf=False):
        bar = tqdm(total=3, desc="working", file=sys.stderr)
        bar.update(1)
        logging.getLogger("accelerate.utils.other").warning("Removed shared tensor {'lm_head.weight'} while saving")
        warnings.warn("a library's\nwarning", UserWarning)
        bar.update(2)
        bar.close()
    assert std.tqdm.display is display  # tqdm as it was afterwards
    out = err.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    assert "Removed shared tensor {'lm_head.weight'} while saving" in lines
    assert any(line.endswith("UserWarning: a library's warning") for line in lines)
    assert lines[-1].startswith("working: 100% 3/3 [") and out.endswith("\n")
    assert len(lines) == 3


def _cli(*args: str, stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "gqakit", *args], stdout=subprocess.PIPE, stderr=stderr,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory) -> tuple[Path, Path, str]:
    """A pico llama with tied embeddings (accelerate warns "Removed shared tensor" at every
    checkpoint), converted by the CLI with stderr a pipe; and an uptrain recipe for it."""
    tmp_path = tmp_path_factory.mktemp("tied")
    src = build("llama", tmp_path / "mha", tie_word_embeddings=True)
    conv = _cli("convert", str(src), str(tmp_path / "g2"), "-g", "2", "--method", "mean")
    assert conv.returncode == 0, conv.stderr.decode()
    cfg = tmp_path / "up.yaml"
    cfg.write_text(yaml.safe_dump(recipe(tmp_path / "g2", tmp_path / "run")))
    return cfg, tmp_path / "run", conv.stderr.decode()


def test_convert_and_uptrain_stderr_off_a_terminal_and_quiet(tied_run: tuple[Path, Path, str]):
    cfg, _, convert_err = tied_run
    assert "\r" not in convert_err and "converting: 100%" in convert_err
    run = _cli("uptrain", str(cfg))
    assert run.returncode == 0, run.stderr.decode()
    err = run.stderr.decode()
    assert "\r" not in err  # no redraws in a log file
    warned = [line for line in err.splitlines() if "Removed shared tensor" in line]
    assert len(warned) == 2 and all(re.match(r"(\[RANK 0\] )?Removed shared tensor", w) for w in warned)
    assert re.search(r"^uptrain: 100% 4/4 \[", err, re.M)

    quiet = _cli("uptrain", str(cfg), "-q", "--overwrite")
    assert quiet.returncode == 0 and quiet.stderr == b""


def test_uptrain_warning_on_a_terminal_is_not_inside_the_bar(tied_run: tuple[Path, Path, str]):
    """stderr a pseudo-terminal: the bar redraws with '\\r', and accelerate's warning is
    written on a line of its own (the bar cleared first), not after the bar's text."""
    cfg, run, _ = tied_run
    tty_cfg = cfg.with_name("tty.yaml")
    tty_cfg.write_text(yaml.safe_dump(recipe(run.parent / "g2", run.parent / "tty-run")))
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 24 x 120: bars need columns
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "gqakit", "uptrain", str(tty_cfg)], stdout=subprocess.DEVNULL,
                            stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=300) == 0
    err = b"".join(chunks).decode(errors="replace")
    assert "\r" in err and "Removed shared tensor" in err  # a real bar, and the warning
    pieces = re.split(r"[\r\n]", err)
    warned = [p for p in pieces if "Removed shared tensor" in p]
    assert len(warned) == 2 and all(re.match(r"(\[RANK 0\] )?Removed shared tensor", w) for w in warned), warned


def test_a_long_bar_off_a_terminal_prints_a_line_now_and_then(monkeypatch):
    """Off a terminal a running bar prints a line once LINE_SECONDS have passed since its
    last one (here 0: at every redraw tqdm makes), and its end once, when it closes."""
    from tqdm import tqdm

    import gqakit.core.quiet as quiet

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(quiet, "LINE_SECONDS", 0.0)
    with quiet_libraries(False, hf=False):
        with tqdm(total=3, desc="layers", file=sys.stderr, mininterval=0, miniters=1) as bar:
            for _ in range(3):
                bar.update(1)
    lines = err.getvalue().splitlines()
    assert "\r" not in err.getvalue()
    assert [line.split(" [")[0] for line in lines] == ["layers: 33% 1/3", "layers: 67% 2/3", "layers: 100% 3/3"]
