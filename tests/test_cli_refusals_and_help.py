"""Small promises of the CLI: an output path of `-` is refused (it would name a file `-`, not
standard output), a conversion that groups nothing needs --force, layers are counted from 1
where a person reads them, `--help` lists the options under headings, without
measurements, and a wrong source, grouping, -g or output is refused before torch is imported."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli_helpers import run_cli

GOLDEN = Path(__file__).parent / "data" / "eval_golden"




def assert_refused(code: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("gqakit: error: "), (code, err)
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def src(tiny_model) -> Path:
    return tiny_model("llama", num_key_value_heads=4)  # 8 query heads, 4 KV heads


# ----------------------------------------------------------------------------- `-` as an output path


def test_dash_output_is_refused_by_every_verb(src, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "valid.txt"
    data.write_text("Once upon a time there was a little model. " * 20)
    results = [shutil.copy(GOLDEN / name, tmp_path / name) for name in ("mha.json", "gqa.json")]
    for args in (["convert", src, "-", "-g", 2],
                 ["convert", src, "-", "-g", 2, "--dry-run"],
                 ["eval", src, "--data", data, "--out", "-"],
                 ["compare", *results, "--out", "-"],
                 ["demo", "--out", "-"]):
        code, out, err = run_cli(args, capsys)
        assert_refused(code, err, "'-'", "standard output")
        assert not (tmp_path / "-").exists(), args
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], args  # no temp or partial folder
    # a dry run checks the output rule as the run does
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, _, err = run_cli(["convert", src, foreign, "-g", 2, "--dry-run"], capsys)
    assert_refused(code, err, "--overwrite")
    code, _, err = run_cli(["convert", src, foreign, "-g", 2, "--dry-run", "--overwrite"], capsys)
    assert_refused(code, err, "not written by gqakit")
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


# ----------------------------------------------------------------------------- -g equal to the KV heads


def test_g_equal_to_the_kv_heads_needs_force(src, tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    for extra in ([], ["--dry-run"], ["--method", "align-refit", "--device", "cpu"]):
        code, _, err = run_cli(["convert", src, out, "-g", 4, *extra], capsys)
        assert_refused(code, err, "--num-kv-heads 4", "KV head count", "--force")
        assert sorted(work.iterdir()) == [], extra  # nothing written, not even a temp folder
    code, _, err = run_cli(["convert", src, out, "-g", 4, "--force", "-q"], capsys)
    assert code == 0 and err == ""
    record = json.loads((out / "gqakit_convert.json").read_text())
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 4
    assert record["settings"]["num_kv_heads"] == 4 and "force" not in record["settings"]
    # any other valid G needs no --force
    code, _, _ = run_cli(["convert", src, work / "g2", "-g", 2, "-q"], capsys)
    assert code == 0


def test_g_equal_to_the_kv_heads_of_a_gguf_needs_force(src, tmp_path, capsys):
    pytest.importorskip("gguf")
    from test_convert_gguf import write_gguf
    from transformers import AutoModelForCausalLM

    path = write_gguf(AutoModelForCausalLM.from_pretrained(src), tmp_path / "m.gguf")
    capsys.readouterr()  # loading the model printed its own bars
    for out in (tmp_path / "o.gguf", tmp_path / "folder"):
        code, _, err = run_cli(["convert", path, out, "-g", 4, "-q"], capsys)
        assert_refused(code, err, "--force")
        assert not out.exists()
    code, _, _ = run_cli(["convert", path, tmp_path / "o.gguf", "-g", 4, "--force", "-q"], capsys)
    assert code == 0 and (tmp_path / "o.gguf").is_file()


def test_the_python_api_and_inspect_still_allow_g_equal_to_the_kv_heads(src, tmp_path, capsys):
    from gqakit.convert import convert_checkpoint
    from gqakit.convert.plan import make_plan
    from gqakit.convert.settings import ConvertSettings
    from gqakit.convert.source import open_model
    from gqakit.core.errors import GqakitError

    assert convert_checkpoint(src, tmp_path / "copy", 4, progress=False).is_dir()  # the exactness checks' path
    with pytest.raises(GqakitError, match="--force"):
        convert_checkpoint(src, tmp_path / "refused", 4, force=False, progress=False)
    assert not (tmp_path / "refused").exists()
    opened = open_model(src, progress=False)
    with pytest.raises(GqakitError, match="--force"):
        make_plan(opened, ConvertSettings(source=src, num_kv_heads=4))
    assert make_plan(opened, ConvertSettings(source=src, num_kv_heads=4, force=True)).output_params > 0
    code, out, _ = run_cli(["inspect", src, "--json"], capsys)
    assert code == 0 and [o["kv_heads"] for o in json.loads(out)["options"]] == [4, 2, 1]


# ----------------------------------------------------------------------------- layers counted from 1


def test_messages_count_layers_from_one(tmp_path):
    from gqakit.convert.pipeline import resume_line
    from gqakit.convert.record import drift_summary

    # the checkpoint's layers_done: 2 layers finished (0-based index of the next one)
    assert resume_line(tmp_path, {"layers_done": 2}, 5).endswith("after layer 2/5 (next: layer 3/5)")
    assert resume_line(tmp_path, None, 5) == f"resuming the conversion in {tmp_path}"
    # residual_drift[i] is measured after the (i+1)-th layer
    line = drift_summary({"tokens": 64, "residual_drift": [0.1, 0.5, 0.2]})
    assert "worst 0.500 after layer 2;" in line


# ----------------------------------------------------------------------------- --help


def _help(cmd) -> str:
    result = CliRunner().invoke(cmd, ["--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


def test_convert_help_has_sections_and_no_measurements():
    from gqakit.convert.cli import CONVERT_OPTION_GROUPS, convert_cmd

    text = _help(convert_cmd)
    headings = [ln[:-1] for ln in text.splitlines() if re.fullmatch(r"\S[^:]*:", ln)]
    assert headings == [title for title, _ in CONVERT_OPTION_GROUPS], headings  # every option in a named group
    assert text.index("Examples:") < text.index("Input and output:")  # examples first
    flat = " ".join(text.split())
    for flag in ("--num-kv-heads", "--force", "--gguf-type", "--device", "--refit-option", "--dry-run", "--help"):
        assert flag in flat
    # what an option does and its default, not what it measured: no seconds, CPUs, GPUs or perplexities
    for needle in ("EPYC", "H100", "perplexity", "hours", "a day", "Measured", "1,534"):
        assert needle not in flat, needle
    assert not re.search(r"\d s\b|\d+ min\b", flat)
    assert "docs/benchmarks.md" in flat
    # every option and align-refit key with its default, and no more: one screenful and a half
    assert len(text.splitlines()) < 160


def test_eval_help_has_sections():
    from gqakit.eval.cli import EVAL_OPTION_GROUPS, eval_cmd

    text = _help(eval_cmd)
    headings = [ln[:-1] for ln in text.splitlines() if re.fullmatch(r"\S[^:]*:", ln)]
    assert headings == [title for title, _ in EVAL_OPTION_GROUPS], headings


def test_grouped_help_lines_up_and_keeps_unnamed_options():
    import click

    from gqakit.core.clihelp import OTHER, GroupedCommand

    @click.command(cls=GroupedCommand, option_groups=[("First", ("b",)), ("Second", ("alpha_long_name",))])
    @click.option("--alpha-long-name", help="A.")
    @click.option("--b", help="B.")
    @click.option("--c", help="C.")
    def cmd(**_):
        pass

    lines = _help(cmd).splitlines()
    assert [ln for ln in lines if ln.endswith(":")] == ["First:", "Second:", f"{OTHER}:"]
    assert lines.index("First:") < lines.index("Second:")
    helps = [ln for ln in lines if ln.startswith("  --")]
    starts = {re.match(r"  \S+(?: \S+)*\s+", ln).end() for ln in helps}
    assert len(helps) == 4 and len(starts) == 1, helps  # one column for every section
    assert lines[lines.index(f"{OTHER}:") + 1].startswith("  --c ")


# ----------------------------------------------------------------------------- refused before the heavy imports


def convert_without_torch(args: list[str]) -> subprocess.CompletedProcess:
    """`gqakit convert ARGS` in a process where `import torch` fails."""
    code = f"import sys; sys.modules['torch'] = None\nfrom gqakit.cli import main\nmain(['convert', *{args!r}])\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.mark.parametrize("case", ["missing", "file", "empty", "no-config", "grouping", "g", "unchanged", "plan"])
def test_a_wrong_source_grouping_or_g_is_refused_without_torch(src, tmp_path, case):
    """With torch unimportable, `gqakit convert` still refuses these with its one line: they are
    answered before any heavy import (a mistyped path costs no start-up)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "model.safetensors").write_bytes(b"")
    (tmp_path / "file").write_text("not a model")
    (tmp_path / "plan.json").write_text('{"kv_heads": [2]}')
    given = {"missing": (str(tmp_path / "nowhere"), "source not found"),
             "file": (str(tmp_path / "file"), "neither a model folder nor a .gguf file"),
             "empty": (str(tmp_path / "empty"), "is empty"),
             "no-config": (str(tmp_path / "no-config"), "no config.json"),
             "grouping": (str(src), "unknown grouping 'nearest'"),
             "g": (str(src), "--num-kv-heads 3 does not divide the model's 4 KV heads"),
             "unchanged": (str(src), "already SRC's KV head count"),
             "plan": (str(src), "--kv-plan gives 1 layers' KV heads")}
    path, needle = given[case]
    args = {"grouping": ["-g", "2", "--grouping", "nearest"], "g": ["-g", "3"], "unchanged": ["-g", "4"],
            "plan": ["--kv-plan", str(tmp_path / "plan.json")]}.get(case, ["-g", "2"])
    r = convert_without_torch([path, str(tmp_path / "out"), *args])
    assert_refused(r.returncode, r.stderr, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["source", "not-ours"])
def test_an_output_that_may_not_be_written_is_refused_without_torch(src, tmp_path, case):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    out, needle = {"source": (src, "is the source"), "not-ours": (other, "not written by gqakit")}[case]
    r = convert_without_torch([str(src), str(out), "-g", "2", "--overwrite"])
    assert_refused(r.returncode, r.stderr, needle)
    assert (other / "todo.txt").read_text() == "mine" and (src / "config.json").is_file()
