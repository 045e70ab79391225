"""`gqakit compare`: several results files -> report.md, report.json and PNG plots.

The first results file is the baseline: perplexity change and decode speedup are quoted
against it. The report is built from the typed results blocks into typed rows
(eval/report_rows.py: `Report`, `ReportRow`, `SpeedEntry`, ...); report.json is its JSON and
report.md is rendered from it, so the two never disagree. A registered measurement's
`ReportSection` (eval/measurement.py) adds its entry to each row and its lines to report.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

from gqakit.core.units import kv_bytes_text
from gqakit.core.errors import GqakitError
from gqakit.core.outdir import atomic_output_dir
from gqakit.core.outrule import REPORT, check_output_path
from gqakit.eval.measurement import Measurement
from gqakit.eval.measures import measurements
from gqakit.eval.records import UNSET, ModelInfo, SpeedPoint, TaskRow, opt
from gqakit.eval.results import SCHEMA, EvalResult, read_results
from gqakit.eval.report_rows import (REPORT_SCHEMA, GridPoint, InputRow, MadeBy, Report, ReportRow, TaskColumn,  # noqa: F401
                                     TaskEntry, TasksHeader)
from gqakit.eval.report_speed import memory_bound_sentence, point_label, speed_entry, speed_section, speedup_text



def _speed_points(res: EvalResult) -> dict[tuple[int, ...], SpeedPoint]:
    return res.speed.points() if res.speed else {}


def method_of(m: ModelInfo) -> str:
    """How the model was made, for its row: "mean, G=2" (gqakit's conversion record), "original,
    G=8" (no record: a model gqakit did not convert), "not recorded, G=2" (results files from before)."""
    c = m.conversion
    if c is UNSET:
        return f"not recorded, G={m.kv_heads}"
    if c is None:
        return f"original, G={m.kv_heads}"
    return f"{c.method}, G={c.num_kv_heads}" + (", uptrained" if c.uptrained else "")


def speed_engine(r: EvalResult) -> str | None:
    """The engine that ran a results file's decode steps (None: no speed block, or a file
    written before engines were recorded)."""
    s = r.speed.settings if r.speed else None
    return s.get("engine") if isinstance(s, dict) else None


def engine_warnings(results: list[EvalResult], names: list[str]) -> list[str]:
    """Decode speed from different engines side by side, or from stock transformers."""
    engines = {n: speed_engine(r) or "gqakit" for n, r in zip(names, results) if r.speed}
    warns = []
    if len(set(engines.values())) > 1:
        warns.append("decode speed was measured on different engines ("
                     + ", ".join(f"{n}: {e}" for n, e in engines.items())
                     + "): its ratios compare the engines as well as the models")
    return warns


# a share of the predicted speedup below this is "little gain"; a predicted speedup below
# LITTLE_PREDICTED promises too little for its shortfall to say anything
LITTLE_SHARE, LITTLE_PREDICTED = 0.5, 1.05


def little_gain_warnings(rows: list[ReportRow], baseline: str) -> list[str]:
    """Rows on the transformers engine whose speedups fall short of what the bytes predict: said
    plainly, since stock transformers is what a plain Hugging Face user runs."""
    warns = []
    for r in rows:
        if r.engine != "transformers" or r.name == baseline:
            continue
        short = [(label, e) for label, e in r.speed.items() if e.ok and e.predicted_speedup_bytes is not UNSET
                 and e.predicted_speedup_bytes >= LITTLE_PREDICTED and e.speedup is not UNSET
                 and (e.speedup_within_noise or (opt(e.share_of_predicted) or 0.0) < LITTLE_SHARE)]
        if short:
            where = ", ".join(f"{label} {e.speedup:.2f}x of {e.predicted_speedup_bytes:.2f}x" for label, e in short)
            warns.append(f"{r.name} on the transformers engine shows little of the speedup its bytes predict "
                         f"({where}): stock transformers (static cache, its own SDPA attention, weights as "
                         "loaded) is what a plain Hugging Face user runs, and its per-step overheads hide the "
                         "bytes GQA saves; `--engine gqakit`, vllm or llama.cpp show what the conversion buys")
    return warns


def comparability_warnings(results: list[EvalResult], names: list[str]) -> list[str]:
    """Say when numbers side by side were not measured the same way."""
    warns = engine_warnings(results, names)
    ppl = [(n, r.perplexity) for n, r in zip(names, results) if r.perplexity]
    if len(ppl) > 1:
        n0, p0 = ppl[0]
        for n, p in ppl[1:]:
            if p.kind != p0.kind:
                warns.append(f"{n} has {OBJECTIVE_WORDS[p.kind]} perplexity, {n0} {OBJECTIVE_WORDS[p0.kind]} "
                             "perplexity: they are not comparable")
                continue
            diffs = [k for k, a, b in (("data", p0.data.get("sha256"), p.data.get("sha256")),
                                       ("context", p0.context, p.context),
                                       ("stride", opt(p0.stride), opt(p.stride)),
                                       ("span seed", _span_seed(p0), _span_seed(p))) if a != b]
            if diffs:
                warns.append(f"{n} was evaluated with different {', '.join(diffs)} than {n0}: "
                             "their perplexities are not comparable")
            elif p0.tokenizer.get("vocab_size") != p.tokenizer.get("vocab_size") or p0.tokens != p.tokens:
                warns.append(f"{n} and {n0} tokenize the data differently: compare bits per byte, not token perplexity")
    for n, r in zip(names, results):
        seen = (r.perplexity.data.get("seen_in_training") if r.perplexity else None) or []
        if seen and isinstance(seen[0], dict):
            warns.append(f"{n} was evaluated on text it was trained on ({seen[0].get('file')}): "
                         "its perplexity is not a held-out number")
    spd = [(n, r.run) for n, r in zip(names, results) if r.speed]
    if len(spd) > 1:
        n0, r0 = spd[0]
        for n, r in spd[1:]:
            if (r.device_name, r.dtype) != (r0.device_name, r0.dtype):
                warns.append(f"{n} was timed on {r.device_name} ({r.dtype}), {n0} on {r0.device_name} "
                             f"({r0.dtype}): speedups mix devices")
    return warns


OBJECTIVE_WORDS = {"causal_lm": "causal-LM", "span_corruption": "span-corruption", "paired": "paired-data"}


def _span_seed(p: Any) -> int | None:
    return p.spans.seed if p.spans else None


def perplexity_settings(p: Any) -> dict[str, Any]:
    """How a perplexity was measured, for the report: context, stride, data, tokenizer, and for an
    encoder-decoder's its objective with the spans' settings or the pairs' fields."""
    out: dict[str, Any] = {"context": p.context, "stride": opt(p.stride), "data": p.data, "tokenizer": p.tokenizer}
    if p.objective:
        out["objective"] = p.objective
        out.update({k: getattr(p, k).to_json() for k in ("spans", "fields") if getattr(p, k)})
    return out


def _task_rows(res: EvalResult) -> dict[str, TaskRow]:
    return res.tasks.rows() if res.tasks else {}


def task_columns(results: list[EvalResult]) -> list[TaskColumn]:
    """One column per (task, metric) any results file has, in the order they first appear."""
    cols: dict[tuple[str, str], TaskColumn] = {}
    for r in results:
        for task, row in _task_rows(r).items():
            for metric, m in row.metrics.items():
                cols.setdefault((task, metric), TaskColumn(task=task, metric=metric, version=opt(row.version),
                                                           n_shot=opt(row.n_shot), examples=row.examples,
                                                           higher_is_better=opt(m.higher_is_better)))
    return list(cols.values())


def task_warnings(results: list[EvalResult], names: list[str]) -> list[str]:
    """Task numbers side by side that were not measured the same way."""
    warns = []
    have = [(n, r) for n, r in zip(names, results) if r.tasks]
    if len(have) < 2:
        return warns
    n0, r0 = have[0]
    v0 = r0.tasks.harness_version
    rows0 = _task_rows(r0)
    for n, r in have[1:]:
        if r.tasks.harness_version != v0:
            warns.append(f"{n} was run with lm-evaluation-harness {r.tasks.harness_version}, {n0} with {v0}")
        for task, row in _task_rows(r).items():
            base = rows0.get(task)
            if base is None:
                continue
            diffs = [what for what, a, b in (
                ("task version", opt(base.version), opt(row.version)),
                ("few-shot count", opt(base.n_shot), opt(row.n_shot)),
                ("number of examples", base.examples, row.examples),
                ("data", base.data_hashes, row.data_hashes)) if a != b]
            if diffs:
                warns.append(f"{task}: {n} was evaluated with a different {', '.join(diffs)} than {n0}: "
                             "its scores are not comparable")
    return warns


def make_report(results: list[EvalResult], names: list[str], command: list[str] | None = None) -> Report:
    """The report, typed: rows, grid, memory-bound points, warnings, provenance."""
    import gqakit

    base = results[0]
    grid = sorted({k for r in results for k in _speed_points(r)}, key=lambda k: (k[1], k[2:], k[0]))
    rows = [report_row(name, r, base, grid) for name, r in zip(names, results)]
    report = Report(
        made_by=MadeBy(command=" ".join(command if command is not None else sys.argv), gqakit=gqakit.__version__,
                       date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")),
        inputs=[InputRow(name=n, command=r.run.command, torch=r.run.torch, transformers=r.run.transformers,
                         gqakit=r.run.gqakit, git=opt(r.run.git), device=r.run.device_name, dtype=r.run.dtype,
                         date=r.run.date) for n, r in zip(names, results)],
        baseline=names[0],
        grid=[GridPoint.of(k) for k in grid],
        perplexity_settings=next((perplexity_settings(r.perplexity) for r in results if r.perplexity), None),
        tasks=(TasksHeader(harness={n: r.tasks.harness_version for n, r in zip(names, results) if r.tasks},
                           columns=task_columns(results)) if any(r.tasks for r in results) else None),
        rows=rows,
        speed_timed_together=_timed_together(results),
        warnings=comparability_warnings(results, names) + little_gain_warnings(rows, names[0])
        + task_warnings(results, names)
        + [w for m in extra_sections().values() if m.report.warnings  # type: ignore[union-attr]
           for w in m.report.warnings(results, names)],  # type: ignore[union-attr]
    )
    by_kind: dict[str, Any] = {}
    for r in results:
        if r.perplexity:
            by_kind.setdefault(r.perplexity.kind, perplexity_settings(r.perplexity))
    if len(by_kind) > 1:  # perplexities of different objectives: how each kind was made
        report.perplexity_settings_by_objective = by_kind
    return report


def build_report(results: list[EvalResult], names: list[str], command: list[str] | None = None) -> dict[str, Any]:
    """The report as report.json holds it (`make_report(...).to_json()`)."""
    return make_report(results, names, command).to_json()


def report_row(name: str, r: EvalResult, base: EvalResult, grid: list[tuple[int, ...]]) -> ReportRow:
    """One model's row, against the baseline `base`, over the report's `grid`."""
    m, p, pts, base_pts = r.model, r.perplexity, _speed_points(r), _speed_points(base)
    row = ReportRow(name=name, path=m.path, method=method_of(m), parameters=m.parameters, heads=m.heads,
                    kv_heads=m.kv_heads, kv_bytes_per_token=m.kv_bytes_per_token, dtype=r.run.dtype,
                    device=r.run.device_name)
    if m.conversion is not UNSET:  # gqakit's conversion record (null: none)
        row.conversion = m.conversion and m.conversion.to_json()
    if m.encoder:  # an encoder-decoder: its encoder, and the cross-attention cache per input token
        row.encoder_kv_heads, row.encoder_heads = m.encoder.kv_heads, m.encoder.heads
        row.cross_kv_bytes_per_token = opt(m.cross_kv_bytes_per_token)
    if p:
        base_ppl = base.perplexity.token_perplexity if base.perplexity else None
        if p.objective:
            row.perplexity_objective = p.objective
        row.perplexity = p.token_perplexity
        same = base_ppl and p.kind == base.perplexity.kind  # no change across objectives
        row.perplexity_delta_pct = (100 * (p.token_perplexity / base_ppl - 1)) if same else None
        if p.bits_per_byte is not UNSET:
            row.bits_per_byte, row.word_perplexity = p.bits_per_byte, p.word_perplexity
    for key in grid:
        if key in pts:
            e = speed_entry(key, pts[key], base_pts.get(key))
            row.speed[point_label(e.axes)] = e
    row.max_batch = {str(mb.prompt_len): mb for mb in (r.speed.max_batch if r.speed else [])}
    row.attention = r.speed.attention.get("decode_path") if r.speed else None
    engine = speed_engine(r)
    if engine is not None:
        row.engine = engine
    note = r.speed.attention.get("kernel_note") if r.speed else None
    if row.attention and note:  # e.g. the CPU kernels did not build here: which path ran, and why
        row.attention += f" ({note})"
    if r.tasks:
        base_tasks = _task_rows(base)
        row.tasks = {}
        for task, trow in _task_rows(r).items():
            row.tasks[task] = {}
            for metric, tm in trow.metrics.items():
                b0 = base_tasks[task].metrics.get(metric) if task in base_tasks else None
                row.tasks[task][metric] = TaskEntry(value=tm.value, stderr=tm.stderr,
                                                    delta=None if b0 is None else tm.value - b0.value)
    for mname, ms in extra_sections().items():  # registered measurements' own entries
        block = r.block(mname)
        entry = ms.report.row(block, base.block(mname) or None) if block else None  # type: ignore[union-attr]
        if entry is not None:
            setattr(row, mname, entry)
    return row


def extra_sections() -> dict[str, Measurement]:
    """The registered measurements beyond the built-in ones that have a report section."""
    return {n: m for n, m in measurements().items() if not m.builtin and m.report is not None}


def _timed_together(results: list[EvalResult]) -> bool:
    together = [r.speed.timed_with for r in results if r.speed]
    return len(together) == len(results) and together[0] is not None and all(t == together[0] for t in together)


def _fmt_num(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.0f}" if abs(x) >= 10 ** digits else f"{x:.{digits}g}"


def task_markdown(report: Report) -> list[str]:
    """The downstream-task table: one row per model, value ± stderr and Δ vs the first row."""
    t = report.tasks
    if not t or not t.columns:
        return []
    versions = sorted(set(t.harness.values()))
    head = ["model"]
    for c in t.columns:
        head += [f"{c.task} {c.metric}", "Δ"]
    out = ["", f"## Downstream tasks (lm-evaluation-harness {', '.join(versions)})", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report.rows:
        cells = [f"**{r.name}**"]
        for c in t.columns:
            m = (r.tasks or {}).get(c.task, {}).get(c.metric)
            if m is None:
                cells += ["—", "—"]
                continue
            cells.append(f"{m.value:.4f}" + (f" ± {m.stderr:.4f}" if m.stderr is not None else ""))
            cells.append("—" if r.name == report.baseline or m.delta is None else f"{m.delta:+.4f}")
        out.append("| " + " | ".join(cells) + " |")
    seen: dict[str, TaskColumn] = {}
    for c in t.columns:
        seen.setdefault(c.task, c)
    out += ["", "Value ± standard error as lm-evaluation-harness reports it; Δ is the difference from the first "
            "row in the metric's own units (higher is better for "
            + ", ".join(sorted({c.metric for c in t.columns if c.higher_is_better})) + "). "
            + "Tasks: " + "; ".join(f"{k} (version {c.version}, {c.n_shot}-shot, {c.examples} examples)"
                                    for k, c in seen.items()) + "."]
    return out


def seq2seq_perplexity_sentence(ps: dict[str, Any]) -> str:
    """What an encoder-decoder's perplexity in the table is of, and how it was made."""
    data = f"data `{ps['data']['path']}` (sha256 {ps['data']['sha256'][:12]}…), tokenizer " \
           f"`{ps['tokenizer']['name_or_path']}`"
    if ps["objective"] == "span_corruption":
        sp = ps.get("spans") or {}
        return (f"Perplexity (span corruption): of the target tokens given the input, on held-out text corrupted "
                f"as T5 pre-trains (noise density {sp.get('noise_density')}, mean span {sp.get('mean_span_length')}, "
                f"seed {sp.get('seed')}), inputs of {ps['context']} tokens; {data}.")
    f = ps.get("fields") or {}
    return (f"Perplexity (paired data): of the target tokens given the input, fields `{f.get('input')}` → "
            f"`{f.get('target')}`, inputs cut to {ps['context']} tokens; bits/byte over the targets' text; {data}.")


def encoder_decoder_sentence(rows: list[ReportRow]) -> list[str]:
    """For encoder-decoders: whose heads the table shows, and the cross-attention cache."""
    ed = [r for r in rows if r.encoder_decoder]
    if not ed:
        return []
    return ["", "Encoder-decoders (" + ", ".join(
        f"{r.name}: encoder {r.encoder_kv_heads} / {r.encoder_heads} KV heads, cross-attention cache "
        + kv_bytes_text(r.cross_kv_bytes_per_token or 0, r.dtype).replace("/token", "")
        + " per input token" for r in ed) + "): KV heads and the KV cache per token are the decoder's, its "
            "self-attention cache per output token."]


def summary_table(report: Report) -> list[str]:
    """The table at the top: one row per model, its perplexity, tokens/s at each grid point, max batch."""
    rows, grid = report.rows, report.grid
    has_ppl = any(r.perplexity is not UNSET for r in rows)
    lens = sorted({int(k) for r in rows for k in r.max_batch})
    head = ["model", "method, G", "params", "KV heads", "KV cache per token"]
    kinds = sorted({r.objective for r in rows if r.perplexity is not UNSET})
    if has_ppl:
        named = ", ".join(OBJECTIVE_WORDS[k] for k in kinds)
        head += ["perplexity" if kinds == ["causal_lm"] else f"perplexity ({named})", f"Δ% vs {report.baseline}",
                 "bits/byte"]
    engines = any(r.engine not in (UNSET, "gqakit") for r in rows)  # a column only when not all on gqakit
    head += ["engine"] if engines else []
    head += [f"tok/s {point_label(g.axes, ' ')}" for g in grid]
    head += [f"max batch p{pl}" for pl in lens]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"**{r.name}**", r.method,
                 f"{r.parameters / 1e6:.2f} M" if r.parameters >= 1e5 else f"{r.parameters:,}",
                 f"{r.kv_heads} / {r.heads}", kv_bytes_text(r.kv_bytes_per_token, r.dtype)]
        if has_ppl:
            d = opt(r.perplexity_delta_pct)
            mixed = len(kinds) > 1 and r.perplexity is not UNSET
            kind = f" ({OBJECTIVE_WORDS[r.objective]})" if mixed else ""
            cells += [_fmt_num(opt(r.perplexity)) + kind,
                      "—" if r.name == report.baseline or d is None else f"{d:+.1f}%",
                      f"{r.bits_per_byte:.3f}" if r.bits_per_byte is not UNSET else "n/a"]
        cells += ["gqakit" if r.engine is UNSET else r.engine] if engines else []
        for g in grid:
            e = r.speed.get(point_label(g.axes))
            if e is None:
                cells.append("—")
            elif not e.ok:
                cells.append("OOM")
            else:
                sp = e.speedup is not UNSET and r.name != report.baseline
                cells.append(f"{e.tokens_per_s:,.1f}" + (f" ({speedup_text(e)})" if sp else ""))
        for pl in lens:
            mb = r.max_batch.get(str(pl))
            cells.append("—" if mb is None else f"{mb.max_batch}{'+' if mb.at_limit else ''}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def render_markdown(report: Report | dict[str, Any], plots: list[str]) -> str:
    """report.md from the report (or report.json's dict)."""
    report = Report.of(report)
    rows, grid = report.rows, report.grid
    out = [f"# gqakit comparison: {', '.join(r.name for r in rows)}", ""]
    if report.warnings:
        out += [f"> **Warning:** {w}" for w in report.warnings] + [""]
    out += summary_table(report)
    out.append("")
    out.append("KV heads are shown as KV / query heads (G is the KV heads); the KV cache per token is in the dtype "
               "each model was evaluated in. Speedups (×) are decode tokens/s against the first row at the same "
               "batch (b) and prompt length (p); tokens/s is the median over repetitions, and a speedup the "
               "repetitions do not separate from 1× is within noise (spread and intervals: the speed section)."
               + (" For an encoder-decoder, p is the input length and o the output length (tokens in the "
                  "self-attention cache when the timed steps start); its predicted bytes include both caches."
                  if any(g.output_len is not UNSET for g in grid) else ""))
    by_kind = report.perplexity_settings_by_objective  # perplexities of several objectives: each one
    for ps in list(by_kind.values()) if by_kind else [p for p in [report.perplexity_settings] if p]:
        if ps.get("objective") in (None, "causal_lm"):
            out += ["", f"Perplexity: context {ps['context']}, stride {ps['stride']}, data `{ps['data']['path']}` "
                    f"(sha256 {ps['data']['sha256'][:12]}…), tokenizer `{ps['tokenizer']['name_or_path']}`."]
        else:
            out += ["", seq2seq_perplexity_sentence(ps)]
    out += encoder_decoder_sentence(rows)
    out += speed_section(report)
    out += task_markdown(report)
    for mname, m in extra_sections().items():
        if m.report.markdown is not None:  # type: ignore[union-attr]
            out += m.report.markdown([r.extra.get(mname) for r in rows], [r.name for r in rows])  # type: ignore[union-attr]
    mb = memory_bound_sentence(report)
    if mb:
        out += ["", "## Where decoding is memory-bound", "",
                "A grid point is memory-bound when its arithmetic intensity (FLOPs per byte a decode step must "
                "read: weights plus the filled KV cache) is below the device's ridge point (measured matmul "
                "FLOP/s over measured copy bandwidth). There, fewer KV heads translate into speed.", ""] + mb
    if any(r.attention for r in rows):
        out += ["", "Attention path in decoding: " + "; ".join(f"{r.name}: {r.attention}" for r in rows
                                                               if r.attention) + "."]
    if plots:
        out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    out += ["", "## Provenance", "", "| model | command | gqakit | git | torch | transformers | device | dtype | date |",
            "|---|---|---|---|---|---|---|---|---|"]
    for i in report.inputs:
        out.append(f"| {i.name} | `{i.command}` | {i.gqakit} | {i.git or 'n/a'} | {i.torch} | "
                   f"{i.transformers} | {i.device} | {i.dtype} | {i.date} |")
    out += ["", f"Report made by `{report.made_by.command}` (gqakit {report.made_by.gqakit}, "
            f"{report.made_by.date}).", ""]
    return "\n".join(out)


def write_report(paths: list[str | Path], out: str | Path, *, names: list[str] | None = None,
                 train_log: str | Path | None = None, overwrite: bool = False,
                 command: list[str] | None = None) -> dict[str, Any]:
    """Read results files, write report.md / report.json / plots into OUT (atomically); returns report.json's dict."""
    from gqakit.eval.plots import make_plots, read_train_log

    results = [read_results(p) for p in paths]
    if names is not None and len(names) != len(results):
        raise GqakitError(f"--names has {len(names)} names for {len(results)} results files")
    names = names or [r.model.name for r in results]
    if len(set(names)) != len(names):  # two folders called `model`: fall back to their file names
        names = [Path(p).stem for p in paths]
    if train_log is not None:
        read_train_log(train_log)  # a bad log is refused before anything is written
    inputs = [("results file", p) for p in paths] + [("training log", train_log)]
    check_output_path(Path(out), overwrite=overwrite, inputs=inputs, kind=REPORT, flag="--out")
    report = make_report(results, names, command)
    if train_log is not None:
        report.train_log = str(train_log)
    with atomic_output_dir(Path(out), overwrite=overwrite, inputs=inputs, kind=REPORT, flag="--out") as tmp:
        report.plots = make_plots(report, results, tmp, train_log=train_log)
        (tmp / "report.json").write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
        (tmp / "report.md").write_text(render_markdown(report, report.plots))
    return report.to_json()


__all__ = ["build_report", "make_report", "method_of", "render_markdown", "write_report", "comparability_warnings",
           "SCHEMA"]
