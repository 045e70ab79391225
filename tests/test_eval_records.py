"""Typed eval results: the JSON they read is the JSON they write, and compare's report is unchanged.

tests/data/eval_golden holds two results files written by `gqakit eval` (pico llama, MHA
and 2 KV heads: perplexity, decode grid, max batch, a local lm-evaluation-harness task)
before the results were typed, a third edited by hand (an out-of-memory point, another
stride, text seen in training, another device, another few-shot count), and the
report.json / report.md that `compare` made of the three before the change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gqakit.core.errors import GqakitError
from gqakit.eval.records import UNSET, SpeedPoint, TaskMetric
from gqakit.eval.report import build_report, render_markdown
from gqakit.eval.results import EvalResult, read_results

GOLDEN = Path(__file__).parent / "data" / "eval_golden"
FILES = ("mha.json", "gqa.json", "odd.json")


@pytest.mark.parametrize("name", FILES)
def test_results_file_round_trips_byte_for_byte(name):
    text = (GOLDEN / name).read_text()
    res = EvalResult.from_json(json.loads(text), GOLDEN / name)
    assert json.dumps(res.to_json(), indent=2, default=str) + "\n" == text


def test_typed_fields_are_read():
    res = EvalResult.from_json(json.loads((GOLDEN / "odd.json").read_text()))
    assert res.model.kv_heads == 2 and res.model.heads == 8
    assert res.perplexity.stride == 8 and res.perplexity.token_perplexity > 1
    ok, oom = res.speed.grid
    assert isinstance(ok, SpeedPoint) and ok.ok and ok.tokens_per_s["median"] > 0
    assert not oom.ok and oom.reason and oom.tokens_per_s is UNSET and "tokens_per_s" not in oom.to_json()
    assert res.speed.max_batch[0].max_batch == 8 and res.speed.max_batch[0].at_limit
    row = res.tasks.results["gqakit_test_mc"]
    assert row.n_shot == 3 and row.examples == 6 and row.version == 2.0
    assert isinstance(row.metrics["acc"], TaskMetric) and 0 <= row.metrics["acc"].value <= 1
    assert row.metrics["acc"].higher_is_better is True and row.metrics["brier_score"].higher_is_better is False


def test_unknown_keys_survive(tmp_path):
    data = json.loads((GOLDEN / "mha.json").read_text())
    data["future"] = {"x": 1}
    data["speed"]["grid"][0]["new_stat"] = 3.5
    res = EvalResult.from_json(data)
    assert res.extra == {"future": {"x": 1}} and res.speed.grid[0].extra == {"new_stat": 3.5}
    assert res.to_json() == data


def test_damaged_file_is_one_line(tmp_path):
    data = json.loads((GOLDEN / "mha.json").read_text())
    data["speed"]["grid"][0]["tokens_per_s"] = None
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    with pytest.raises(GqakitError, match="speed.grid.0"):
        read_results(p)


def test_compare_report_is_the_one_made_before_typing():
    results = [read_results(GOLDEN / f) for f in FILES]
    rep = build_report(results, ["mha", "gqa", "odd"], command=["gqakit", "compare"])
    rep["made_by"]["date"] = "DATE"
    assert json.dumps(rep, indent=2, default=str) + "\n" == (GOLDEN / "report.json").read_text()
    assert render_markdown(rep, ["speed_vs_batch.png"]) == (GOLDEN / "report.md").read_text()


def test_builtin_blocks_are_registered_blocks_held_by_name():
    """perplexity, speed and tasks are blocks of registered measurements like any other: the
    file itself declares only schema, run and model; the result holds the blocks by name, and
    writes them in the order the measurements were registered, then the keys it does not know."""
    from gqakit.eval.measures import measurements
    from gqakit.eval.records import PerplexityResult, SpeedResult, TasksResult
    from gqakit.eval.results import BLOCKS

    assert set(EvalResult.model_fields) == {"schema_", "run", "model"}
    assert list(BLOCKS)[:3] == ["perplexity", "speed", "tasks"] == list(measurements())[:3]
    assert [BLOCKS[n] for n in ("perplexity", "speed", "tasks")] == [PerplexityResult, SpeedResult, TasksResult]
    data = json.loads((GOLDEN / "odd.json").read_text())
    res = EvalResult.from_json(data)
    assert list(res.blocks) == ["perplexity", "speed", "tasks"] and res.extra == {}
    assert res.block("speed") is res.speed and isinstance(res.speed, SpeedResult)
    again = EvalResult(schema=data["schema"], run=res.run, model=res.model, future={"x": 1})
    for name in ("tasks", "perplexity", "speed"):  # set out of order
        again.set_block(name, res.block(name))
    assert list(again.to_json()) == ["schema", "run", "model", "perplexity", "speed", "tasks", "future"]
    assert {k: v for k, v in again.to_json().items() if k != "future"} == data
    again.set_block("speed", UNSET)
    assert "speed" not in again.to_json() and again.speed is UNSET


def test_a_reader_that_imports_only_the_results_module_gets_typed_blocks():
    """The built-in measurements register as `gqakit.eval` is imported: a fresh process that
    reads a results file through eval.results alone sees typed blocks, not raw dicts."""
    import os
    import subprocess
    import sys

    code = ("import sys; from gqakit.eval.results import read_results; r = read_results(sys.argv[1]); "
            "print(type(r.perplexity).__name__, type(r.speed).__name__, type(r.tasks).__name__)")
    got = subprocess.run([sys.executable, "-c", code, str(GOLDEN / "gqa.json")], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["PerplexityResult", "SpeedResult", "TasksResult"]
