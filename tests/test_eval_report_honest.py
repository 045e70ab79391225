"""`gqakit compare`'s report says how sure its speed numbers are and what each row is:
spread over repetitions, speedups and shares within noise said as such, method and G per
row, one KV-bytes definition with its dtype (shared with `inspect` and the convert card),
training and held-out loss on separate axes, and no file an installed gqakit lacks."""

from __future__ import annotations

import json
import re

import pytest
import torch

from gqakit.cli import main
from gqakit.core.units import kv_bytes_text
from gqakit.eval.records import ConversionInfo, ModelInfo, RunInfo, SpeedPoint, SpeedResult
from gqakit.eval.report import build_report, render_markdown
from gqakit.eval.results import SCHEMA, EvalResult, read_results, write_results
from gqakit.eval.speed.point import timings

RUN = dict(command="gqakit eval", date="2026-01-01", gqakit="0", torch="2", transformers="5", device_name="cpu",
           dtype="float32")


def cli(args: list[str], capsys) -> str:
    try:
        main(args)
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    return capsys.readouterr().out


def point(batch: int, steps_s: list[float], total_bytes: float) -> SpeedPoint:
    """An ok grid point from per-repetition step times (seconds) and the bytes a step reads."""
    return SpeedPoint(batch=batch, prompt_len=8, new_tokens=4, status="ok", reps=len(steps_s),
                      **timings(batch, [1e-3] * len(steps_s), steps_s), roofline_fraction=0.5, memory_bound=True,
                      bytes_per_step={"weights": 1000, "kv": total_bytes - 1000, "total": total_bytes},
                      roofline_ms={"bytes": total_bytes / 1e6, "flops": 1e-6})


def result(name: str, kv_heads: int, grid: list[SpeedPoint], conversion=None) -> EvalResult:
    return EvalResult(schema=SCHEMA, run=RunInfo(**RUN),
                      model=ModelInfo(path=f"/m/{name}", parameters=1000, heads=8, kv_heads=kv_heads,
                                      kv_bytes_per_token=64 * kv_heads, conversion=conversion),
                      speed=SpeedResult(grid=grid))


def report_of(base_steps, other_steps, *, predicted_bytes=(2000.0, 1000.0)):
    base = result("mha", 8, [point(1, base_steps, predicted_bytes[0])])
    other = result("gqa", 2, [point(1, other_steps, predicted_bytes[1])],
                   ConversionInfo(method="mean", num_kv_heads=2, grouping="contiguous"))
    rep = build_report([base, other], ["mha", "gqa"], command=["gqakit", "compare"])
    return rep, render_markdown(rep, [])


def test_timings_record_the_spread_over_repetitions():
    t = timings(2, [0.01, 0.02], [0.004, 0.002, 0.003])
    assert t["tokens_per_s"] == pytest.approx({"median": 2 / 0.003, "p90_of_step_time": t["tokens_per_s"]["p90_of_step_time"],
                                               "min": 2 / 0.004, "max": 2 / 0.002})
    assert t["decode_ms_per_token"]["min"] == pytest.approx(2.0) and t["decode_ms_per_token"]["max"] == pytest.approx(4.0)
    assert t["prefill_ms"]["min"] == pytest.approx(10.0) and t["prefill_ms"]["max"] == pytest.approx(20.0)


def test_spread_round_trips_through_the_results_file(tmp_path):
    res = result("gqa", 2, [point(1, [0.004, 0.002, 0.003], 1000.0)], ConversionInfo(method="mean", num_kv_heads=2))
    p = write_results(res, tmp_path / "r.json")
    back = read_results(p)
    assert back.speed.grid[0].tokens_per_s["min"] == pytest.approx(250.0)
    assert back.model.conversion.method == "mean" and back.model.conversion.num_kv_heads == 2
    assert json.loads(p.read_text()) == back.to_json()


def test_noisy_speedup_is_within_noise_and_has_no_negative_share():
    # medians say 0.95x (a slowdown) against a predicted 2x, but the repetitions overlap
    rep, md = report_of([0.010, 0.009, 0.011], [0.0105, 0.0095, 0.012])
    e = rep["rows"][1]["speed"]["b1_p8"]
    lo, hi = e["speedup_interval"]
    assert lo < 1 < hi and e["speedup_within_noise"] is True
    assert e["share_of_predicted"] < 0 and e["share_of_predicted_within_noise"] is True
    assert "within noise" in md
    assert not re.search(r"-\d+%", md), "a negative share is printed as a finding"
    assert f"{e['speedup']:.2f}×" not in md
    assert "90.9–111.1" in md  # the baseline's tokens/s range is shown


def test_clear_speedup_is_a_finding_with_its_interval():
    rep, md = report_of([0.010, 0.0102, 0.0098], [0.0066, 0.0065, 0.0067])
    e = rep["rows"][1]["speed"]["b1_p8"]
    assert e["speedup_within_noise"] is False and e["speedup_interval"][0] > 1
    assert e["share_of_predicted_within_noise"] is False and 0 <= e["share_of_predicted"] <= 1.5
    assert f"({e['speedup']:.2f}×)" in md
    assert f"{100 * e['share_of_predicted']:.0f}%" in md


def test_share_outside_0_to_150_percent_is_noise_even_when_the_speedup_is_clear():
    # a clear 1.5x speedup against a predicted 1.01x: the share (~5000%) means nothing
    rep, md = report_of([0.0150, 0.0151, 0.0149], [0.0100, 0.0101, 0.0099], predicted_bytes=(1010.0, 1000.0))
    e = rep["rows"][1]["speed"]["b1_p8"]
    assert e["speedup_within_noise"] is False and e["share_of_predicted"] > 1.5
    assert e["share_of_predicted_within_noise"] is True
    assert f"{100 * e['share_of_predicted']:.0f}%" not in md


def test_rows_say_method_and_g_and_the_report_names_no_uninstalled_file():
    rep, md = report_of([0.010], [0.007])
    assert [r["method"] for r in rep["rows"]] == ["original, G=8", "mean, G=2"]
    assert "| **gqa** | mean, G=2 |" in md and "| **mha** | original, G=8 |" in md
    assert not re.search(r"\bbench/", md + json.dumps(rep))  # the benchmark scripts are not installed


def test_conversion_info_reads_the_models_conversion_record(tmp_path):
    from gqakit.eval.provenance import conversion_info

    (tmp_path / "gqakit_convert.json").write_text(json.dumps(
        {"settings": {"method": "align-refit", "grouping": "similarity"}, "num_kv_heads": 4}))
    assert conversion_info(tmp_path).to_json() == {"method": "align-refit", "num_kv_heads": 4,
                                                   "grouping": "similarity", "uptrained": False}
    (tmp_path / "gqakit_uptrain.yaml").write_text("x: 1\n")
    assert conversion_info(tmp_path).uptrained is True
    assert conversion_info(tmp_path / "nowhere") is None


def test_training_and_held_out_loss_are_separate_labelled_series():
    from gqakit.eval.plots import loss_figure

    rows = [{"step": s, "loss": 4 - s / 10, "kl": 1 / s, "hidden_mse": 0.5 / s} for s in range(1, 6)]
    rows.append({"step": 5, "eval_loss": 3.2})
    fig = loss_figure(rows)
    axes = fig.get_axes()
    labels = [ax.get_ylabel() for ax in axes]
    assert len(axes) == 4 and all(len(ax.get_lines()) == 1 for ax in axes)
    assert labels[-1] == "held-out cross-entropy (nats/token)"
    assert sum("nats/token" in lab for lab in labels) == 2  # the two cross-entropies, nothing else
    assert "KL" in labels[1] and "hidden-state MSE" in labels[2]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_inspect_card_and_report_agree_on_kv_bytes_and_name_the_dtype(tiny_model, tmp_path, capsys):
    from gqakit.convert import convert_checkpoint
    from gqakit.core.loading import load_causal_lm
    from gqakit.eval.provenance import model_info

    src = tiny_model("llama", num_key_value_heads=8)
    out = convert_checkpoint(src, tmp_path / "g2", 2, method="mean")
    expected = kv_bytes_text(2 * 2 * 2 * 4 * 4, "float32")  # K and V x layers x G x head_dim x fp32 bytes
    text = cli(["inspect", str(src)], capsys)
    assert re.search(r"^\s+2\s+4\s+" + re.escape(expected), text, re.M), text
    card = (out / "README.md").read_text()
    assert expected in card
    assert json.loads((out / "gqakit_convert.json").read_text())["kv_cache_dtype"] == "float32"
    model = load_causal_lm(out)
    res = EvalResult(schema=SCHEMA, run=RunInfo(**RUN), model=model_info(model, out, torch.float32.itemsize))
    rep = build_report([res], ["g2"], command=["gqakit", "compare"])
    md = render_markdown(rep, [])
    assert expected in md and rep["rows"][0]["method"] == "mean, G=2"
    # a 16-bit cache, asked for, is named as such
    assert kv_bytes_text(2 * 2 * 2 * 4 * 2, "16-bit") in cli(["inspect", str(src), "--dtype-bytes", "2"], capsys)


def test_card_prices_the_cache_in_the_dtype_it_saves(tiny_model, tmp_path):
    """--dtype bfloat16 saves 16-bit weights: the card and record price a 16-bit cache and say so."""
    from gqakit.convert import convert_checkpoint

    out = convert_checkpoint(tiny_model("llama"), tmp_path / "bf16", 2, method="mean", dtype="bfloat16",
                             progress=False)
    record = json.loads((out / "gqakit_convert.json").read_text())
    assert record["kv_cache_dtype"] == "bfloat16"
    assert record["kv_cache_bytes_per_token_after"] == 2 * 2 * 2 * 4 * 2  # K, V x layers x G x head_dim x 2 bytes
    assert kv_bytes_text(64, "bfloat16") in (out / "README.md").read_text()
