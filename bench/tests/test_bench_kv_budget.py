"""bench/bench_kv_budget.py on a pico Llama: a plan's perplexity measured on the source with the
pooled heads repeated back equals the perplexity of the model `gqakit convert` writes, and the
rows, the table and the plot come out."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_kv_budget import main, table

TEXT = "".join(chr(33 + (i * 7919) % 61) + (" " if i % 5 == 4 else "") for i in range(8000))


@pytest.fixture
def pico(tiny_model, tmp_path):
    (tmp_path / "calib.txt").write_text(TEXT[:4000])
    (tmp_path / "eval.txt").write_text(TEXT[4000:])
    return tiny_model("llama", num_key_value_heads=4, num_hidden_layers=3), tmp_path


def args(src: Path, tmp: Path, *extra: str) -> list[str]:
    return ["custom", "--src", str(src), "--data", str(tmp / "eval.txt"), "--calibration-data",
            str(tmp / "calib.txt"), "--calibration-tokens", "512", "--method", "mean", "--context", "64", *extra]


def test_equivalence_equals_the_converted_model(pico):
    src, tmp = pico
    eq = main(args(src, tmp, "--budgets", "0.5", "0.25", "--uniform", "1", "--original", "--out",
                   str(tmp / "eq.jsonl"), "--plot", str(tmp / "curve.png")))
    conv = main(args(src, tmp, "--budgets", "0.25", "--uniform", "1", "--via", "convert", "--out",
                     str(tmp / "cv.jsonl")))
    by = {(r["kind"], r["plan"]): r for r in eq}
    cv = {(r["kind"], r["plan"]): r for r in conv}
    # float32 perplexity of the same function, computed in two op orders (a repeat vs grouped heads)
    assert cv["uniform", "G=1"]["ppl"] == pytest.approx(by["uniform", "G=1"]["ppl"], rel=1e-4)
    assert cv["budget", "0.25"]["ppl"] == pytest.approx(by["budget", "0.25"]["ppl"], rel=1e-4)
    assert by["budget", "0.25"]["kv_heads"] == [1, 1, 1]  # the smallest cache: one plan only
    assert by["budget", "0.5"]["kv_bytes_per_token"] <= by["original", "-"]["kv_bytes_per_token"] // 2
    assert by["original", "-"]["fraction"] == 1 and by["uniform", "G=1"]["fraction"] == 0.25
    assert (tmp / "curve.png").stat().st_size > 1000 and len((tmp / "eq.jsonl").read_text().splitlines()) == 4
    assert "--kv-budget 0.5" in table(eq) and "uniform G=1" in table(eq)


def test_a_hand_written_plan_is_converted_and_measured(pico):
    """`--plan`: a per-layer plan of one's own, written by `gqakit convert --kv-plan`, has the
    perplexity of the same plan applied in place; a plan of the wrong length is refused."""
    src, tmp = pico
    eq = main(args(src, tmp, "--budgets", "0.5", "--uniform", "--plan", "4,1,2", "--out", str(tmp / "eq.jsonl")))
    conv = main(args(src, tmp, "--budgets", "0.5", "--uniform", "--plan", "4,1,2", "--via", "convert", "--out",
                     str(tmp / "cv.jsonl")))
    e, c = ({r["kind"]: r for r in rows}["plan"] for rows in (eq, conv))
    assert e["kv_heads"] == c["kv_heads"] == [4, 1, 2] and c["fraction"] == round(7 / 12, 4)
    assert c["ppl"] == pytest.approx(e["ppl"], rel=1e-4)  # the same function in two op orders, as above
    assert "--kv-plan 4,1,2" in table(conv)
    with pytest.raises(SystemExit):
        main(args(src, tmp, "--budgets", "0.5", "--plan", "4,1", "--out", str(tmp / "bad.jsonl")))
