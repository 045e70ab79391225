"""The measurement seam (eval/measurement.py): a metric written as one module and registered
(tests/count_measurement.py) gets its options, its block in the results file, and its part of
`gqakit compare`'s report, with no edit anywhere else; the built-in ones go through it too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))

import count_measurement  # noqa: E402
from gqakit.core.errors import GqakitError  # noqa: E402
from gqakit.eval.cli import eval_option_groups, make_eval_command  # noqa: E402
from gqakit.eval.measures import measurements, nothing_to_measure  # noqa: E402
from gqakit.eval.results import read_results  # noqa: E402
from gqakit.eval.report import build_report, render_markdown, write_report  # noqa: E402

TEXT = " ".join(f"w{i % 13} x{i % 7}y z" for i in range(60))


@pytest.fixture
def count():
    count_measurement.install()
    yield count_measurement
    count_measurement.uninstall()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny_models import build

    root = tmp_path_factory.mktemp("count")
    return {name: build("llama", root / name, num_key_value_heads=kv) for name, kv in (("mha", 4), ("gqa", 2))}


def eval_cli(args):
    """The command built now (with what is registered now); a GqakitError as gqakit's main prints it."""
    res = CliRunner().invoke(make_eval_command(), [str(a) for a in args])
    if isinstance(res.exception, GqakitError):
        return 2, res.output + str(res.exception)
    return res.exit_code, res.output


def test_builtin_measurements_are_registered_in_order():
    assert list(measurements())[:3] == ["perplexity", "speed", "tasks"]
    assert nothing_to_measure() == "nothing to measure: pass --data (perplexity), --speed, --tasks, --check, or several"


def test_registered_measurement_has_its_options_and_help_section(count):
    cmd = make_eval_command()
    names = [p.name for p in cmd.params]
    assert {"count_text", "count_limit"} <= set(names)
    # its asking option comes with the others that ask for a measurement, before --out
    assert names.index("count_text") < names.index("out") < names.index("count_limit")
    assert ("Token count", ("count_text", "count_limit")) in eval_option_groups()
    code, out = eval_cli(["--help"])
    assert code == 0 and "Token count:" in out and "--count-text TEXT" in out
    assert "--count-text" in nothing_to_measure()


def test_unregistered_command_has_no_toy_options():
    assert "count_text" not in [p.name for p in make_eval_command().params]


def test_toy_measurement_in_results_and_compare(count, models, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    outs = []
    for name, folder in models.items():
        out = tmp_path / f"{name}.json"
        code, output = eval_cli([folder, "--count-text", text, "--data", text, "--context", 16, "--out", out, "-q"])
        assert code == 0, output
        assert f"tokens in {len(TEXT)} characters" in output  # its summary line
        outs.append(out)
    data = json.loads(outs[0].read_text())
    assert list(data)[-2:] == ["perplexity", "count"]  # after the built-in blocks
    assert data["count"]["chars"] == len(TEXT) and data["count"]["tokens"] > 0
    res = read_results(outs[0])
    assert isinstance(res.block("count"), count.CountResult)  # typed as it is read
    assert res.to_json() == data  # and written back byte for byte

    report = write_report(outs, tmp_path / "rep", names=["mha", "gqa"], command=["gqakit", "compare"])
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["mha"]["count"] == {"tokens": data["count"]["tokens"], "delta": 0}
    assert rows["gqa"]["count"]["delta"] == 0  # same tokenizer
    on_disk = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert on_disk["rows"][0]["count"] == rows["mha"]["count"]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Token count" in md and f"- gqa: {data['count']['tokens']} tokens" in md


def test_toy_measurement_checks_before_loading_and_names_its_input(count, models, tmp_path):
    code, out = eval_cli([models["mha"], "--count-text", tmp_path / "nope.txt", "--out", tmp_path / "r.json"])
    assert code != 0 and "--count-text: no such file" in out and not (tmp_path / "r.json").exists()
    code, out = eval_cli([models["mha"], "--count-limit", 3, "--out", tmp_path / "r.json"])
    assert code != 0 and "--count-limit goes with --count-text FILE" in out
    # OUT is never one of the measurement's inputs
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    code, out = eval_cli([models["mha"], "--count-text", text, "--out", text, "--overwrite"])
    assert code != 0 and "count text" in out and text.read_text() == TEXT


def test_damaged_toy_block_is_one_line(count, tmp_path):
    golden = json.loads((Path(__file__).parent / "data" / "eval_golden" / "mha.json").read_text())
    golden["count"] = {"path": "t.txt", "chars": 3, "tokens": "many"}
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(golden))
    with pytest.raises(GqakitError, match=r"count\.tokens"):
        read_results(p)
    golden["count"] = None
    p.write_text(json.dumps(golden))
    with pytest.raises(GqakitError, match="count is null"):
        read_results(p)


def test_unregistered_block_is_kept_as_it_is(tmp_path):
    golden = json.loads((Path(__file__).parent / "data" / "eval_golden" / "mha.json").read_text())
    golden["count"] = {"path": "t.txt", "chars": 3, "tokens": "many"}
    p = tmp_path / "future.json"
    p.write_text(json.dumps(golden))
    res = read_results(p)
    assert res.block("count") == golden["count"] and res.to_json() == golden
    rep = build_report([res], ["mha"], command=["gqakit", "compare"])
    assert "count" not in rep["rows"][0] and "Token count" not in render_markdown(rep, [])


def test_registering_twice_or_a_results_key_is_refused(count):
    from gqakit.eval.measurement import register

    with pytest.raises(GqakitError, match="already registered"):
        register(count.COUNT)
    from dataclasses import replace

    with pytest.raises(GqakitError, match="key of the results file"):
        register(replace(count.COUNT, name="model"))


# ----------------------------------------------------------------------------- one Bench protocol

BENCH_METHODS = ("probe", "open_point", "rep", "begin_rep", "timed_step", "close_point", "point_cost", "point_path",
                 "prefill_fields")


def test_both_benches_follow_the_bench_protocol():
    from gqakit.eval.speed import Bench, DecodeBench, Seq2SeqBench

    assert set(BENCH_METHODS) <= {n for n in dir(Bench) if not n.startswith("_")}
    for cls in (DecodeBench, Seq2SeqBench):
        assert all(callable(getattr(cls, n, None)) for n in BENCH_METHODS), cls


def test_one_summarize_from_the_bench_cost():
    """A bench written against the protocol alone is summarized: the bytes it says a step reads
    over the median step time is the bandwidth; FLOPs per byte against the ridge, memory-bound."""
    import types

    from gqakit.eval.speed import OpenPoint, PointCost, summarize
    from gqakit.eval.speed.point import timings

    class Fake:
        device = types.SimpleNamespace(type="cpu")

        def point_cost(self, pt):
            return PointCost(bytes={"weights": 600, "kv": 400, "total": 1000}, flops=2000.0, kv_analytic=512)

        def point_path(self, pt, graph_used):
            return "fake", {"steps": "fake"}

        def prefill_fields(self, pt):
            return {"prefill_ms": {"median": 1.0, "p90": 1.0}, "prefill_samples": 1, **timings(pt.batch, [], pt.dec)}

    pt = OpenPoint(batch=2, prompt_len=8, new_tokens=3, dec=[0.5, 0.25, 1.0], reps=3)
    roof = {"copy_bandwidth": 8000.0, "matmul_flops": 1e6, "ridge_flops_per_byte": 4.0}
    got = summarize(Fake(), pt, roof, peak=None)
    # exact: the same few float operations in the same order as the expected values
    assert got.achieved_bandwidth_gbs == 1000 / 0.5 / 1e9 and got.roofline_fraction == 1000 / 0.5 / 8000.0
    assert got.arithmetic_intensity == 2.0 and got.memory_bound is True
    assert got.bytes_per_step["total"] == 1000 and got.kv_cache_bytes_analytic == 512
    assert got.decode_path == {"steps": "fake"} and got.tokens_per_s["median"] == 2 / 0.5
