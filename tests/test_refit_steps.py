"""align-refit's reconstruction steps: which span each step trains on (every span once per
epoch, reshuffled, fixed by the seed), when the guard is evaluated, and early stopping on it."""

from __future__ import annotations

import pytest
import torch

from gqakit.convert.calibration import CalibrationStage
from gqakit.convert.calibration.refit import EarlyStop, check_steps, span_order
from gqakit.convert.plan import make_plan
from gqakit.convert.settings import ConvertSettings
from gqakit.convert.source import open_model


def test_span_order_is_fixed_by_the_seed_and_covers_every_span_each_epoch():
    a = span_order(8, 20, torch.Generator().manual_seed(3))
    b = span_order(8, 20, torch.Generator().manual_seed(3))
    c = span_order(8, 20, torch.Generator().manual_seed(4))
    assert a == b
    assert a != c
    assert len(a) == 20
    assert sorted(a[:8]) == list(range(8)) and sorted(a[8:16]) == list(range(8))  # two whole epochs
    assert a[:8] != a[8:16]  # reshuffled per epoch (these seeds' two orders differ)
    assert len(set(a[16:])) == 4  # the part of the third epoch taken repeats no span
    assert span_order(5, 0, torch.Generator().manual_seed(0)) == []


@pytest.mark.parametrize("steps, checks, want", [
    (400, 4, {100, 200, 300, 400}),
    (10, 4, {2, 5, 8, 10}),
    (3, 4, {1, 2, 3}),  # at most one per step
    (7, 1, {7}),
    (0, 4, set()),
])
def test_guard_checks_are_evenly_spaced_and_end_at_the_last_step(steps, checks, want):
    assert check_steps(steps, checks) == want


def test_early_stopping_stops_after_patience_evaluations_without_improvement():
    stop = EarlyStop(1.0, patience=2)
    fake = [0.9, 0.8, 0.85, 0.79, 0.8, 0.81, 0.7]  # improves, improves, not, improves, not, not: stop
    seen = []
    for i, loss in enumerate(fake, start=1):
        seen.append(stop.update(loss, i * 10))
        if stop.stop:
            break
    assert seen == [True, True, False, True, False, False]
    assert (stop.best, stop.best_at) == (0.79, 40)


def test_without_patience_it_never_stops():
    stop = EarlyStop(0.5, patience=0)
    for i in range(100):
        stop.update(1.0, i)
    assert not stop.stop
    assert (stop.best, stop.best_at) == (0.5, 0)  # the closed-form start stays the best


def _run(src, **refit):
    settings = ConvertSettings(source=src, num_kv_heads=1, method="align-refit", calibration_tokens=512,
                               grouping="contiguous", refit={"seq_len": 32, "batch": 2, "holdout": 0.25,
                                                             "guard_spans": 2, "train": "attention", **refit})
    opened = open_model(src)
    plan = make_plan(opened, settings)
    stage = CalibrationStage(opened, plan, plan.settings, device="cpu", progress=False)
    return dict(stage.layers()), stage.summary


def test_a_layer_stops_early_when_the_guard_stops_improving(tiny_model, one_thread):
    """A learning rate far too high makes every step worse than the closed-form fit: with
    patience 2 each layer stops after its second guard evaluation (step 2 x 40 / 10), keeps the
    closed-form weights, and gives what no steps at all give."""
    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=2)
    heads, summary = _run(src, steps=40, lr=50.0, guard_checks=10, patience=2)
    rec = summary["reconstruction"]
    assert [r["steps_taken"] for r in rec] == [8, 8], rec
    assert all(r["best_step"] == 0 for r in rec)
    full, summary_full = _run(src, steps=40, lr=50.0, guard_checks=10)  # no patience: every step
    assert [r["steps_taken"] for r in summary_full["reconstruction"]] == [40, 40]
    for L in heads:  # the closed-form fit kept either way
        torch.testing.assert_close(heads[L].o, full[L].o, rtol=0, atol=0)


def test_steps_are_deterministic_under_a_seed(tiny_model, one_thread):
    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=2)
    a, sa = _run(src, steps=12, lr=1e-2)
    b, sb = _run(src, steps=12, lr=1e-2)
    assert all(r["best_step"] > 0 for r in sa["reconstruction"])  # the steps changed the weights
    for L in a:
        torch.testing.assert_close(a[L].q, b[L].q, rtol=0, atol=0)
        torch.testing.assert_close(a[L].o, b[L].o, rtol=0, atol=0)


def test_the_model_card_line_says_when_layers_stop_early():
    from gqakit.convert.calibration.refit import AlignRefit

    record = {"options": {"steps": 40, "lr": 0.01, "train": "attention", "patience": 3}, "reconstruction": [{}]}
    assert "stops after 3 guard evaluations without improvement" in AlignRefit.describe(record)
    record["options"]["patience"] = 0
    assert "stops after" not in AlignRefit.describe(record)
