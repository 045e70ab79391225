"""core/run.py: one run context says whether bars are drawn and whether the run is quiet."""

from __future__ import annotations

import threading

from gqakit.core.run import RunContext, current, running, show_bars


def test_the_default_outside_a_run():
    assert current() == RunContext(progress=True, quiet=False) and show_bars() is True


def test_a_run_sets_it_for_its_block_and_restores_it():
    with running(progress=False) as ctx:
        assert current() is ctx and not show_bars() and not ctx.quiet
        with running(quiet=True):
            assert current() == RunContext(progress=False, quiet=True)  # quiet draws no bars
        assert current() is ctx
        assert show_bars(True) is True  # an explicit progress= still overrides
    assert current() == RunContext()


def test_the_context_survives_an_exception_in_the_block():
    try:
        with running(progress=False, quiet=True):
            raise KeyError
    except KeyError:
        pass
    assert current() == RunContext()


def test_another_thread_does_not_see_this_runs_context():
    seen = []
    with running(progress=False, quiet=True):
        t = threading.Thread(target=lambda: seen.append(current()))
        t.start()
        t.join()
    assert seen == [RunContext()]


def test_eval_measures_read_the_context_run_eval_sets(tiny_model, tmp_path, monkeypatch, capfd):
    """`run_eval(quiet=True)` reaches the perplexity bar through the context, not through an
    argument of every call between."""
    import gqakit.eval.perplexity as ppl
    from gqakit.eval import runner
    from gqakit.eval.perplexity import PerplexitySettings

    seen = []
    real = ppl.evaluate_perplexity
    monkeypatch.setattr(ppl, "evaluate_perplexity",
                        lambda *a, **k: seen.append((k["progress"], current())) or real(*a, **k))
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    src = tiny_model("llama")
    runner.run_eval(src, perplexity=PerplexitySettings(data=text, window={"context": 16}), device="cpu", quiet=True)
    assert seen == [(False, RunContext(progress=False, quiet=True))]
    assert current() == RunContext()
    runner.run_eval(src, perplexity=PerplexitySettings(data=text, window={"context": 16}), device="cpu", progress=False)
    assert seen[-1] == (False, RunContext(progress=False, quiet=False))


def test_progress_as_overrides_bars_and_keeps_quiet():
    from gqakit.core.run import progress_as

    with progress_as(None) as ctx:
        assert ctx == RunContext()
    with running(quiet=True), progress_as(True):
        assert current() == RunContext(progress=False, quiet=True)  # a quiet run stays without bars
    with progress_as(False):
        assert current() == RunContext(progress=False, quiet=False)
    assert current() == RunContext()


def _spy_on_the_pipeline(monkeypatch) -> list[RunContext]:
    """The run context the conversion's plan and its calibration stage are made in."""
    import gqakit.convert.calibration as calibration
    import gqakit.convert.pipeline as pipeline

    seen: list[RunContext] = []
    real_plan, real_stage = pipeline.make_plan, calibration.CalibrationStage.__init__
    monkeypatch.setattr(pipeline, "make_plan", lambda *a, **k: seen.append(current()) or real_plan(*a, **k))

    def stage(self, *a, **k):
        seen.append(current())
        real_stage(self, *a, **k)

    monkeypatch.setattr(calibration.CalibrationStage, "__init__", stage)
    return seen


def test_a_quiet_convert_prints_nothing_and_a_loud_one_shows_its_bars(tiny_model, tmp_path, monkeypatch, capfd):
    """`gqakit.convert(..., quiet=True)` sets the run context that the pipeline and the
    calibration stage read (no `progress=` passed down): nothing on stdout or stderr. The same
    conversion without it draws the stage's and the writer's bars."""
    import gqakit

    seen = _spy_on_the_pipeline(monkeypatch)
    src = tiny_model("llama", num_key_value_heads=4)
    capfd.readouterr()
    kw = dict(num_kv_heads=2, method="align-refit", calibration_tokens=128, refit={"seq_len": 32}, device="cpu")
    gqakit.convert(src, tmp_path / "quiet", quiet=True, **kw)
    out = capfd.readouterr()
    assert (out.out, out.err) == ("", "")
    assert seen == [RunContext(progress=False, quiet=True)] * 2
    seen.clear()
    gqakit.convert(src, tmp_path / "loud", **kw)
    err = capfd.readouterr().err
    assert "calibrating layer" in err and seen == [RunContext()] * 2, err
    assert current() == RunContext()


def test_cli_quiet_prints_nothing_for_convert_eval_compare_and_uptrain(tiny_model, tmp_path, capfd):
    """-q: nothing on stderr, and not even the closing 'wrote ...' line on stdout; eval still
    prints the numbers it measured (the answer it was asked for). Without -q the 'wrote' lines
    are there, and convert's bar on stderr."""
    import yaml
    from test_cli_refusals_and_help import run_cli
    from test_uptrain import cfg

    src = tiny_model("llama", num_key_value_heads=4)
    capfd.readouterr()
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    recipe = tmp_path / "up.yaml"
    recipe.write_text(yaml.safe_dump(cfg(tmp_path / "g2", tmp_path / "run", tokens=16 * 2 * 2)))
    verbs = [["convert", src, tmp_path / "g2", "-g", "2", "--method", "mean"],
             ["eval", tmp_path / "g2", "--data", text, "--context", "16", "--out", tmp_path / "e.json"],
             ["compare", tmp_path / "e.json", "--out", tmp_path / "cmp"],
             ["uptrain", recipe]]
    for args in verbs:
        code, out, err = run_cli([*args, "-q"], capfd)
        if args[0] == "eval":
            assert code == 0 and err == "" and "perplexity" in out and "wrote" not in out, (out, err)
        else:
            assert code == 0 and (out, err) == ("", ""), (args[0], out, err)
    loud = {}
    for args in verbs:
        code, out, err = run_cli([*args, "--overwrite"], capfd)
        assert code == 0, (args[0], err)
        loud[args[0]] = (out, err)
    assert loud["convert"][0].startswith("wrote ") and "converting" in loud["convert"][1], loud["convert"]
    assert "perplexity" in loud["eval"][0] and "wrote " in loud["eval"][0], loud["eval"]
    assert loud["compare"][0].startswith("wrote "), loud["compare"]
