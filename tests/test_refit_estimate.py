"""The expected time of a calibrated conversion comes from a measured probe of its first layer,
scaled by what the run does: it grows with the layers, the calibration tokens and the steps as
the work does. Timed by a fake clock (each reading one second later), so no assertion depends
on this machine's speed."""

from __future__ import annotations

import itertools

import pytest

from gqakit.convert.calibration.estimate import Rates, expected_seconds, rates_from_ticks, run_shape
from gqakit.convert.calibration.probe import probe
from gqakit.convert.plan import make_plan
from gqakit.convert.settings import ConvertSettings
from gqakit.convert.source import open_model


def test_rates_come_from_the_units_times():
    # 3 spans: moments 1 s, o_proj fits 2 s, 8 steps of 5 s with a guard (3 spans x 3 s) after every
    # other step, the converted stream's advance 3 s; each pass's first unit 10 s more (reading the
    # block, solving). The guard after a step lands in the next interval; the initial one in the first.
    d = [11, 1, 1, 12, 2, 2] + [5 + 9 + 10, 5, 5 + 9, 5, 5 + 9, 5, 5 + 9, 5] + [3 + 9 + 10, 3, 3]
    ticks = list(itertools.accumulate([0.0, *d]))
    r = rates_from_ticks(ticks, spans=3, steps=8, guard_spans=8, prepare_seconds=6.0, sampled=False)
    assert (r.fit_span, r.forward_span, r.step, r.prepare) == (1.5, 3.0, 5.0, 6.0)
    # what the units leave: the fixed part of a layer, so that the model gives back the probe's own time
    assert r.layer_fixed == 4 * 10  # each pass's first 10 s and the steps' set-up: the fixed part
    # and the model gives the probe's own time back whole
    assert r.per_layer(3, 8, 8) == pytest.approx(ticks[-1] - ticks[0])


def test_rates_count_o_projs_refit_after_the_steps():
    # as above, with o_proj's refit after the steps (`final_o`): 3 more units of 4 s, the first taking the
    # guard after the last step; the guard on its result lands in the advance's first unit
    d = [11, 1, 1, 12, 2, 2] + [5 + 9 + 10, 5, 5 + 9, 5, 5 + 9, 5, 5 + 9, 5] + [4 + 9, 4, 4] + [3 + 9 + 10, 3, 3]
    ticks = list(itertools.accumulate([0.0, *d]))
    r = rates_from_ticks(ticks, spans=3, steps=8, guard_spans=8, prepare_seconds=6.0, sampled=False, final=True)
    assert (r.fit_span, r.forward_span, r.step, r.final_span, r.layer_fixed) == (1.5, 3.0, 5.0, 4.0, 40)
    assert r.per_layer(3, 8, 8) == pytest.approx(ticks[-1] - ticks[0])
    # twice the spans (the guard on as many): twice the refit's units; a layer without steps takes none
    assert r.per_layer(6, 8, 3) - r.per_layer(3, 8, 3) == pytest.approx(3 * (2 * 1.5 + 3.0 + 4.0))
    assert r.per_layer(3, 0, 8) == 40 + 3 * (2 * 1.5 + 3.0)


def test_rates_of_passes_that_run_two_spans_at_once():
    # as the first test, with 4 spans run two at a time (`stage.pass_groups`): a group's two units tick
    # together, the first after the group's whole time, the second at once; the first group of each
    # pass also reads the block or solves (10 s)
    d = ([10 + 2, 0, 2, 0] + [10 + 4, 0, 4, 0] + [5 + 9 + 10, 5, 5 + 9, 5, 5 + 9, 5, 5 + 9, 5]
         + [10 + 6, 0, 6, 0])
    ticks = list(itertools.accumulate([0.0, *d]))
    r = rates_from_ticks(ticks, spans=4, steps=8, guard_spans=8, prepare_seconds=6.0, sampled=False, group=2)
    assert (r.fit_span, r.forward_span, r.step) == (1.5, 3.0, 5.0)
    assert r.per_layer(4, 8, 8) == pytest.approx(ticks[-1] - ticks[0])


def test_passes_run_spans_together_up_to_their_tokens():
    from gqakit.convert.calibration.stage import PASS_TOKENS, pass_groups

    one = [slice(i, i + 1) for i in range(5)]  # 5 spans of one 512-token sequence: two at a time, one left
    assert PASS_TOKENS == 1024
    assert pass_groups(one, 1, 512) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert pass_groups(one, 1, 128) == [slice(0, 5)]  # 8 fit, 5 there are
    four = [slice(0, 4), slice(4, 8), slice(8, 10)]  # spans of 4 x 512 tokens: each alone
    assert pass_groups(four, 4, 512) == four


def test_expected_time_scales_with_layers_tokens_and_steps():
    r = Rates(fit_span=1.0, forward_span=2.0, step=3.0, layer_fixed=5.0, prepare=5.0, sampled=False)
    one = expected_seconds(r, layers=1, spans=10, steps=100, guard_spans=8)
    assert one == 5 + 5 + 10 * (2 * 1 + 2) + 100 * 3 + 5 * 8 * 2
    assert expected_seconds(r, layers=30, spans=10, steps=100, guard_spans=8) - 5 == pytest.approx(30 * (one - 5))
    # twice the tokens: twice the span passes, the same steps
    twice = expected_seconds(r, layers=1, spans=20, steps=100, guard_spans=8)
    assert twice - one == pytest.approx(10 * 4)
    # sampled text: the preparation per generate call
    sampled = Rates(**{**r.__dict__, "sampled": True})
    assert expected_seconds(sampled, layers=1, spans=10, steps=100, guard_spans=8, generate_calls=3) == one + 10
    assert expected_seconds(r, layers=1, spans=10, steps=0, guard_spans=8) == one - 100 * 3 - 80


@pytest.mark.parametrize("steps", [0, 6])
def test_probe_runs_the_first_layer_and_scales_to_the_run(tiny_model, steps):
    clock = itertools.count().__next__  # one second per reading
    shapes = {}
    for layers in (2, 4):
        src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=layers)
        s = ConvertSettings(source=str(src), num_kv_heads=2, method="align-refit", calibration_tokens=512,
                            refit={"steps": steps, "seq_len": 32})
        opened = open_model(src, progress=False)
        plan = make_plan(opened, s)
        rates = probe(opened, plan, plan.settings, device="cpu", clock=clock)
        assert (rates.fit_span, rates.forward_span, rates.step) == (1.0, 1.0, 1.0 if steps else 0.0)
        shape = run_shape(plan, plan.settings)
        assert shape["spans"] == 512 // 32 // 4 and shape["steps"] == steps and shape["layers"] == layers
        assert shape["trained"] == (layers if steps else 0)
        shapes[layers] = (rates, shape)
    r2, s2 = shapes[2]
    total2 = expected_seconds(r2, **s2)
    more = {**s2, "layers": 4, "trained": 4 if steps else 0}
    assert expected_seconds(r2, **more) - total2 == pytest.approx(2 * r2.per_layer(
        s2["spans"], s2["steps"], s2["guard_spans"]))
    # layers that keep their KV heads (a per-layer plan's) take no steps: they cost a layer without them
    kept = expected_seconds(r2, **{**more, "trained": 1 if steps else 0})
    p0, ps = (r2.per_layer(s2["spans"], n, s2["guard_spans"]) for n in (0, s2["steps"]))
    assert kept - total2 == pytest.approx(3 * p0 - ps if steps else 2 * p0)  # 1 + 3 layers against 2
    assert expected_seconds(r2, **{**s2, "spans": 2 * s2["spans"]}) > total2


def test_dry_run_says_the_expected_time_and_writes_nothing(tiny_model, tmp_path, capsys):
    from gqakit.cli import main

    src = tiny_model("llama", num_key_value_heads=4)
    out = tmp_path / "out"
    main(["convert", str(src), str(out), "-g", "2", "--method", "align-refit", "--device", "cpu",
          "--calibration-tokens", "256", "--refit-option", "steps=3", "--dry-run"])
    text = capsys.readouterr()
    assert "expected time: about" in text.out + text.err and "per layer x 2 layers, 3 steps each" in text.out + text.err
    assert not out.exists()


def test_the_run_says_its_expected_time_after_a_few_steps_of_the_first_layer(tiny_model, tmp_path, capsys):
    from gqakit.cli import main

    src = tiny_model("llama", num_key_value_heads=4)
    main(["convert", str(src), str(tmp_path / "out"), "-g", "2", "--method", "align-refit", "--device", "cpu",
          "--calibration-tokens", "256", "--refit-option", "steps=12"])
    err = capsys.readouterr().err
    early = err.index("measured on the first layer's passes and 8 steps; 2 layers)")
    assert "per layer: " in err[:early] and early < err.index("measured on the first; 1 of 2 layers to go")


def test_a_per_layer_plan_says_its_expected_time_early_when_its_first_layer_keeps_its_heads(tiny_model, tmp_path,
                                                                                             capsys):
    """The early line comes from the first layer that takes steps, and counts the kept layers after
    it as layers without steps."""
    import json

    from gqakit.cli import main

    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=3)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kv_heads": [4, 2, 4]}))
    main(["convert", str(src), str(tmp_path / "out"), "--kv-plan", str(plan), "--method", "align-refit",
          "--device", "cpu", "--calibration-tokens", "256", "--refit-option", "steps=12"])
    err = capsys.readouterr().err
    assert "measured on the first layer's passes and 8 steps; 1 layer, and 1 without steps)" in err, err


def test_the_first_layers_line_scales_by_each_layers_steps():
    """After the first layer the stage says the expected time from that layer's seconds; where the
    layers differ (a per-layer plan's kept layers take no steps), by their progress units."""
    from gqakit.convert.calibration.stage import expected_time

    same = expected_time(10.0, 60.0, 3, 4)
    assert "about 3 min 10 s in all, 3 min 00 s left" in same and "scaled" not in same
    # the first layer took 60 s for 100 units; the 3 left have 100 + 20 + 20 units
    mixed = expected_time(10.0, 60.0, 3, 4, left_units=1.4)
    assert "about 1 min 34 s in all, 1 min 24 s left" in mixed and "scaled by each layer's steps" in mixed
