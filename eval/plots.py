"""PNG plots for `gqakit compare`: decode speed against batch and context, perplexity, task scores, loss.

Plain matplotlib (Agg backend, no display needed), one figure per question, large
enough fonts to read in a Markdown viewer, and a log axis wherever the values span
orders of magnitude (batch sizes, converted-model perplexities in the thousands).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError, first_line
from gqakit.eval.records import SpeedPoint
from gqakit.eval.results import EvalResult
from gqakit.eval.report_rows import Report

MARKERS = "osD^v<>p*h"


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": 110})
    return plt


def _ok(res: EvalResult) -> list[SpeedPoint]:
    return [g for g in (res.speed.grid if res.speed else []) if g.ok]


def _speed_plot(results: list[EvalResult], names: list[str], out: Path, *, x_key: str, panel_key: str,
                xlabel: str, panel_label: str, title: str) -> bool:
    panels = sorted({getattr(g, panel_key) for r in results for g in _ok(r)})
    xs_all = sorted({getattr(g, x_key) for r in results for g in _ok(r)})
    if not panels or len(xs_all) < 1:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5.5, 4.8 * len(panels)), 4.2), squeeze=False)
    for ax, pv in zip(axes[0], panels):
        for i, (n, r) in enumerate(zip(names, results)):
            pts = sorted((getattr(g, x_key), g.tokens_per_s["median"]) for g in _ok(r) if getattr(g, panel_key) == pv)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=MARKERS[i % len(MARKERS)], label=n, lw=2)
        if len(xs_all) > 1 and xs_all[-1] / xs_all[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all)
        ax.set_xticklabels([str(x) for x in xs_all])
        ax.set_title(f"{panel_label} {pv}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("decode tokens/s (median)")
        ax.set_ylim(bottom=0)
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def _ppl_plot(results: list[EvalResult], names: list[str], out: Path) -> bool:
    vals = [(n, r.perplexity.token_perplexity) for n, r in zip(names, results) if r.perplexity]
    if not vals:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(vals) + 2), 4.2))
    bars = ax.bar([v[0] for v in vals], [v[1] for v in vals], color=[f"C{i}" for i in range(len(vals))])
    if max(v[1] for v in vals) / min(v[1] for v in vals) > 20:
        ax.set_yscale("log")
        ax.set_ylabel("token perplexity (log scale)")
    else:
        ax.set_ylabel("token perplexity")
    for b, (_, v) in zip(bars, vals):
        ax.annotate(f"{v:,.2f}" if v < 1000 else f"{v:,.0f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=10)
    ax.margins(y=0.15)
    p = results[0].perplexity
    if p and p.kind != "causal_lm":  # an encoder-decoder's: of the target tokens given inputs of `context` tokens
        ax.set_title(f"{p.kind.replace('_', '-').capitalize()} perplexity of the targets (inputs of {p.context} tokens)")
    else:
        ax.set_title(f"Perplexity (context {p.context if p else None}, stride {p.stride if p else None})")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def _tasks_plot(report: Report, out: Path) -> bool:
    """Grouped bars: one group per task metric, one bar per model, stderr as error bars."""
    t = report.tasks
    if not t or not t.columns:
        return False
    import numpy as np

    cols, rows = t.columns, report.rows
    plt = _plt()
    x = np.arange(len(cols))
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cols) * max(1, len(rows)) + 2), 4.5))
    for i, r in enumerate(rows):
        ms = [(r.tasks or {}).get(c.task, {}).get(c.metric) for c in cols]
        vals = [m.value if m else np.nan for m in ms]
        errs = [m.stderr if m and m.stderr is not None else 0.0 for m in ms]
        ax.bar(x + (i - (len(rows) - 1) / 2) * width, vals, width, yerr=errs, capsize=3, label=r.name,
               color=f"C{i}")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{c.task}\n{c.metric}" for c in cols], fontsize=9)
    ax.set_ylabel("score (error bars: ± stderr)")
    ax.set_title("Downstream tasks (lm-evaluation-harness)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def read_train_log(path: str | Path) -> list[dict[str, Any]]:
    """Rows of an uptraining log: uptrain's log.jsonl (or its run folder), or a CSV with step,loss."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "log.jsonl"
    if not p.is_file():
        raise GqakitError(f"training log not found: {p}")
    rows: list[dict[str, Any]] = []
    try:
        if p.suffix == ".csv":
            import csv

            with p.open() as f:
                rows = [{k: float(v) for k, v in r.items() if v not in (None, "")} for r in csv.DictReader(f)]
        else:
            rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    except (ValueError, OSError) as e:
        raise GqakitError(f"cannot read training log {p}: {first_line(e, None)}") from None
    if not any("loss" in r or "eval_loss" in r for r in rows):
        raise GqakitError(f"training log {p} has no 'loss' or 'eval_loss' values")
    return rows


# The series of an uptraining log, each on its own axes with its own label: the training
# objective's terms (uptrain/losses.py LOSS_TERMS: their log.jsonl keys) are measured on the
# training batches, against the teacher where there is one; the held-out loss is the
# cross-entropy of held-out text. They are different quantities and never share an axis.
LOSS_SERIES = (
    ("loss", "training loss (cross-entropy on the training batches, nats/token)"),
    ("kl", "training KL to the teacher"),
    ("hidden_mse", "training hidden-state MSE"),
    ("layer_mse", "training layer-local MSE"),
    ("eval_loss", "held-out cross-entropy (nats/token)"),
)


def loss_figure(rows: list[dict[str, Any]]) -> Any:
    """The uptraining log as a matplotlib figure: one panel per series the log has (LOSS_SERIES),
    each labelled with what it is; None when the log has no series with steps."""
    series = [(key, label, [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))
                            and "step" in r]) for key, label in LOSS_SERIES]
    series = [s for s in series if s[2]]
    if not series:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(series), figsize=(4.6 * len(series) + 0.8, 4.2), squeeze=False)
    for i, (ax, (key, label, pts)) in enumerate(zip(axes[0], series)):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o--" if key == "eval_loss" else "-", lw=2,
                color=f"C{i}", label=label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label, fontsize=9)
        ax.set_title("held-out" if key == "eval_loss" else "training", fontsize=10)
    fig.suptitle("Uptraining")
    fig.tight_layout()
    return fig


def _loss_plot(rows: list[dict[str, Any]], out: Path) -> bool:
    fig = loss_figure(rows)
    if fig is None:
        return False
    fig.savefig(out)
    _plt().close(fig)
    return True


def make_plots(report: Report, results: list[EvalResult], folder: Path,
               train_log: str | Path | None = None) -> list[str]:
    """Write the PNGs that have data; returns their file names (relative to the report)."""
    names = [r.name for r in report.rows]
    made = []
    if _speed_plot(results, names, folder / "speed_vs_batch.png", x_key="batch", panel_key="prompt_len",
                   xlabel="batch size", panel_label="prompt length", title="Decode throughput vs batch size"):
        made.append("speed_vs_batch.png")
    if _speed_plot(results, names, folder / "speed_vs_context.png", x_key="prompt_len", panel_key="batch",
                   xlabel="prompt length (tokens)", panel_label="batch", title="Decode throughput vs context length"):
        made.append("speed_vs_context.png")
    if _ppl_plot(results, names, folder / "perplexity.png"):
        made.append("perplexity.png")
    if _tasks_plot(report, folder / "tasks.png"):
        made.append("tasks.png")
    if train_log is not None and _loss_plot(read_train_log(train_log), folder / "uptrain_loss.png"):
        made.append("uptrain_loss.png")
    return made
