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
