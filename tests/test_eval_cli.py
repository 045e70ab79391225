"""`gqakit eval` and `gqakit compare` end to end through the CLI entry point."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gqakit.cli import main
from gqakit.eval.results import SCHEMA

TEXT = " ".join(f"w{i % 13} x{i % 7}y z" for i in range(120))
SPEED = ["--speed", "--batch", "1,2", "--prompt-len", "8", "--new-tokens", "3", "--reps", "2", "--warmup", "1"]


def run(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def ok(args, capsys):
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    return capsys.readouterr().out


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "d.txt"
    p.write_text(TEXT)
    return p


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Results of an MHA pico model and its 2-KV-head sibling, made once through the CLI."""
    import os
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import build

    root = tmp_path_factory.mktemp("ev")
    (root / "d.txt").write_text(TEXT)
    outs = []
    for name, kv in (("mha", 8), ("gqa", 2)):
        folder = build("llama", root / name, num_key_value_heads=kv)
        out = root / f"{name}.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        r = subprocess.run([sys.executable, "-m", "gqakit", "eval", str(folder), "--data", str(root / "d.txt"),
                            "--context", "32", "--stride", "16", *SPEED, "--out", str(out), "-q"],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        outs.append(out)
    return root, outs


def test_eval_writes_traceable_results(evaluated):
    root, (mha, gqa) = evaluated
    res = json.loads(gqa.read_text())
    assert res["schema"] == SCHEMA
    for key in ("command", "torch", "transformers", "device_name", "dtype", "date"):
        assert res["run"][key]
    assert "--context 32 --stride 16" in res["run"]["command"] and "--compile" not in res["run"]["command"]
    assert res["model"]["kv_heads"] == 2 and res["model"]["heads"] == 8
    p = res["perplexity"]
    assert p["context"] == 32 and p["stride"] == 16 and p["tokens"] > 32
    assert p["data"]["path"].endswith("d.txt") and len(p["data"]["sha256"]) == 64
    assert p["tokenizer"]["name_or_path"]
    assert {g["status"] for g in res["speed"]["grid"]} == {"ok"}
    assert json.loads(mha.read_text())["model"]["kv_bytes_per_token"] == 4 * res["model"]["kv_bytes_per_token"]


def test_compare_report(evaluated, tmp_path, capsys):
    root, (mha, gqa) = evaluated
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 4 - s / 10}) + "\n" for s in range(1, 11))
                   + json.dumps({"step": 10, "eval_loss": 3.2}) + "\n")
    out = tmp_path / "rep"
    ok(["compare", str(mha), str(gqa), "--names", "mha,gqa", "--train-log", str(log), "--out", str(out)], capsys)
    md = (out / "report.md").read_text()
    rep = json.loads((out / "report.json").read_text())
    assert [r["name"] for r in rep["rows"]] == ["mha", "gqa"]
    mha_r, gqa_r = rep["rows"]
    expected = 100 * (gqa_r["perplexity"] / mha_r["perplexity"] - 1)
    assert gqa_r["perplexity_delta_pct"] == pytest.approx(expected)
    assert f"{expected:+.1f}%" in md
    sp = gqa_r["speed"]["b2_p8"]
    assert sp["speedup"] == pytest.approx(sp["tokens_per_s"] / mha_r["speed"]["b2_p8"]["tokens_per_s"])
    assert "| **gqa** |" in md and "memory-bound" in md and "gqakit compare" in md
    # the prediction sits next to the measurement at every grid point
    m_pt, g_pt = (json.loads(f.read_text())["speed"]["grid"][1] for f in (mha, gqa))
    pred = m_pt["bytes_per_step"]["total"] / g_pt["bytes_per_step"]["total"]
    assert pred > 1 and sp["predicted_speedup_bytes"] == pytest.approx(pred)
    assert sp["share_of_predicted"] == pytest.approx((sp["speedup"] - 1) / (pred - 1))
    assert "## Decode speed, its spread, and the prediction" in md and f"{pred:.2f}×" in md
    # every point's spread over the repetitions, in the JSON and the report; each row's method and G
    for pt in json.loads(gqa.read_text())["speed"]["grid"]:
        assert pt["tokens_per_s"]["min"] <= pt["tokens_per_s"]["median"] <= pt["tokens_per_s"]["max"]
    assert sp["tokens_per_s_min"] <= sp["tokens_per_s"] <= sp["tokens_per_s_max"]
    assert f"{sp['tokens_per_s_min']:,.1f}–{sp['tokens_per_s_max']:,.1f}" in md
    assert [r["method"] for r in rep["rows"]] == ["original, G=8", "original, G=2"]
    assert not re.search(r"\bbench/", md)  # the benchmark scripts are not installed: never recommended
    assert all("predicted_speedup_bytes" in e for e in gqa_r["speed"].values())
    assert set(rep["plots"]) == {"speed_vs_batch.png", "speed_vs_context.png", "perplexity.png", "uptrain_loss.png"}
    for p in rep["plots"]:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not rep["warnings"]


def test_compare_warns_on_different_data(evaluated, tmp_path, capsys):
    root, (mha, gqa) = evaluated
    other = json.loads(gqa.read_text())
    other["perplexity"]["data"]["sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    ok(["compare", str(mha), str(tmp_path / "other.json"), "--out", str(tmp_path / "r")], capsys)
    assert "not comparable" in (tmp_path / "r" / "report.md").read_text()


def test_compare_rejects_non_results(tmp_path, capsys):
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    code, _, err = run(["compare", str(tmp_path / "x.json"), "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "not a gqakit results file" in err and "Traceback" not in err
    (tmp_path / "y.json").write_text("{oops")
    code, _, err = run(["compare", str(tmp_path / "y.json"), "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "not valid JSON" in err


@pytest.mark.parametrize("args,msg", [
    (["--context", "4096"], "larger than the model"),
    (["--context", "16", "--stride", "32"], "--stride"),
    (["--context", "100000000"], "larger than the model"),
])
def test_eval_bad_window(tiny_model, data, tmp_path, capsys, args, msg):
    code, _, err = run(["eval", str(tiny_model("llama")), "--data", str(data), *args, "--out", str(tmp_path / "o.json")],
                       capsys)
    assert code == 2 and msg in err


def test_eval_bad_inputs(tiny_model, tmp_path, capsys):
    folder = tiny_model("llama")
    code, _, err = run(["eval", str(tmp_path / "nope"), "--data", "x", "--out", str(tmp_path / "o.json")], capsys)
    assert code == 2 and "model not found" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (tmp_path / "d.txt").write_text(TEXT)
    code, _, err = run(["eval", str(broken), "--data", str(tmp_path / "d.txt"), "--out", str(tmp_path / "o.json")], capsys)
    assert code == 2 and "gqakit: error:" in err and "Traceback" not in err
    code, _, err = run(["eval", str(folder), "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o.json")], capsys)
    assert code == 2 and "data file not found" in err
    code, _, err = run(["eval", str(folder), "--out", str(tmp_path / "o.json")], capsys)
    assert code == 2 and "nothing to measure" in err


def test_help_has_examples(capsys):
    for verb in ("eval", "compare"):
        assert "Examples:" in ok([verb, "--help"], capsys)


def test_flag_defaults_are_the_settings_defaults():
    """The eval flags' defaults are the settings models' defaults: one default per setting."""
    from gqakit.eval.cli import eval_cmd
    from gqakit.eval.perplexity import PerplexitySettings, Window
    from gqakit.eval.tasks import TaskSettings

    flags = {p.name: p.default for p in eval_cmd.params}
    pairs = [("context", Window, "context"), ("stride", Window, "stride"),
             ("max_chars", PerplexitySettings, "max_chars"), ("text_field", PerplexitySettings, "text_field"),
             ("num_fewshot", TaskSettings, "num_fewshot"), ("limit", TaskSettings, "limit"),
             ("tasks_path", TaskSettings, "tasks_path"), ("tasks_batch", TaskSettings, "batch_size")]
    for flag, model, field in pairs:
        assert flags[flag] == model.model_fields[field].default, flag


def test_settings_are_checked_when_built(tmp_path):
    """Window, PerplexitySettings and TaskSettings refuse bad values in one line, and unknown keys."""
    from pydantic import ValidationError

    from gqakit.core.errors import GqakitError
    from gqakit.eval.perplexity import PerplexitySettings, Window
    from gqakit.eval.tasks import TaskSettings

    for kw, msg in [({"context": 1}, "--context"), ({"context": 8, "stride": 9}, "--stride"),
                    ({"stride": 0}, "--stride")]:
        with pytest.raises(GqakitError, match=msg):
            Window(**kw)
    with pytest.raises(GqakitError, match="--max-chars"):
        PerplexitySettings(data=tmp_path / "d.txt", max_chars=0)
    with pytest.raises(GqakitError, match="--tasks-batch"):
        TaskSettings(tasks=["t"], batch_size=0)
    with pytest.raises(ValidationError, match="conext"):
        Window(conext=16)
    s = PerplexitySettings(data="hf:wikitext:wikitext-2-raw-v1:test")
    assert s.data.is_dataset and s.data.file is None and s.window.stride_tokens == 512
    assert PerplexitySettings(data=tmp_path / "d.txt").data.file == tmp_path / "d.txt"
