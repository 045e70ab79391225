"""Golden losses: four fixed-seed optimizer steps with every loss term on, against values
recorded from this code on the CPU in float32 (torch 2.x). A change to the training step,
the loss terms, the data order or the schedule moves them; a refactor must not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gqakit.uptrain import run_uptrain
from test_uptrain import cfg, converted, mha, rows  # noqa: F401  (fixtures)

# step -> (loss, kl, hidden_mse, layer_mse, grad_norm), as logged in log.jsonl
GOLDEN = {
    1: (4.129688008626302, 0.00030998215079307555, 0.0023037657141685487, 0.004043083886305491, 0.23358090221881866),
    2: (4.14969482421875, 0.00023237209146221479, 0.002282021939754486, 0.004154795904954275, 0.2577108144760132),
    3: (4.125855000813802, 0.0004082322120666504, 0.002442119518915812, 0.003313781569401423, 0.3223620057106018),
    4: (4.123103332519531, 0.0004917522271474203, 0.0024007387459278108, 0.004336455464363098, 0.3119972050189972),
}
EVAL_PPL = (64.04407205134403, 64.04332153927224)  # before the first step, after the last


def test_four_steps_reproduce_the_golden_losses(converted: Path, mha: Path, tmp_path: Path):
    c = cfg(converted, tmp_path / "run", tokens=16 * 2 * 4)
    c["teacher"] = {"path": str(mha), "kl_weight": 0.5, "hidden_weight": 0.1, "layer_weight": 0.2}
    final = run_uptrain(c, quiet=True)
    log = rows(tmp_path / "run")
    train = {r["step"]: r for r in log if "loss" in r}
    assert sorted(train) == sorted(GOLDEN)
    for step, want in GOLDEN.items():
        r = train[step]
        got = (r["loss"], r["kl"], r["hidden_mse"], r["layer_mse"], r["grad_norm"])
        assert got == pytest.approx(want, rel=1e-4, abs=1e-7), step
    assert [r["eval_ppl"] for r in log if "eval_ppl" in r] == pytest.approx(EVAL_PPL, rel=1e-5)
    card = (final / "README.md").read_text()
    for line in ("| final train loss | 4.1231 |", "| teacher KL weight | 0.5 |", "| teacher hidden-state weight | 0.1 |",
                 "| teacher layer-local weight | 0.2 |"):
        assert line in card
    assert json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[0])["step"] == 0
