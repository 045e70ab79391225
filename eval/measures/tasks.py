"""The lm-evaluation-harness tasks measurement (eval/tasks.py), as registered with `gqakit eval`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gqakit.core.errors import GqakitError
from gqakit.eval.measurement import Context, Flags, Measurement, flag, register
from gqakit.eval.records import TasksResult


class TasksFlags(Flags):
    tasks: Any = flag("--tasks", help="lm-evaluation-harness tasks, comma-separated (needs gqakit[tasks]).")
    num_fewshot: Any = flag("--num-fewshot", type=int,
                            help="Few-shot examples per task (default: each task's own).")
    limit: Any = flag("--limit", type=int, help="Use only the first N examples of each task (quick checks).")
    tasks_path: Any = flag("--tasks-path", type=click.Path(path_type=Path),
                           help="Folder of local task YAML files (over local data files), added to the harness's "
                                "tasks.")
    tasks_batch: Any = flag("--tasks-batch", default=1, show_default=True, help="Batch size of the task requests.")


def settings(f: TasksFlags) -> Any:
    if f.tasks is None:
        if f.num_fewshot is not None or f.limit is not None or f.tasks_path is not None:
            raise GqakitError("--num-fewshot, --limit and --tasks-path go with --tasks NAMES")
        return None
    from gqakit.eval.tasks import TaskSettings, parse_tasks

    return TaskSettings(tasks=parse_tasks(f.tasks), num_fewshot=f.num_fewshot, limit=f.limit,
                        tasks_path=f.tasks_path, batch_size=f.tasks_batch)


def prepare(s: Any, model_path: str | Path, encoder_decoder: bool, quiet: bool) -> None:
    from gqakit.core.quiet import quiet_libraries
    from gqakit.eval.tasks import check_seq2seq_tasks, check_tasks, load_tasks

    check_tasks(s, quiet=quiet)  # harness installed, names known, local data present: before loading
    with quiet_libraries(quiet):
        load_tasks(s, quiet=quiet)  # their datasets read (offline) before the model loads
    if encoder_decoder:
        check_seq2seq_tasks(s)


def run(ctx: Context, s: Any, prepared: Any) -> TasksResult:
    from gqakit.core.loading import load_tokenizer
    from gqakit.eval.tasks import run_tasks

    return run_tasks(ctx.model, load_tokenizer(ctx.model_path), s, progress=ctx.progress, quiet=ctx.quiet)


def inputs(s: Any) -> list[tuple[str, Any]]:
    return [("tasks folder", s.tasks_path)] if s.tasks_path is not None else []


def summary(t: TasksResult) -> list[str]:
    lines = [f"tasks (lm-evaluation-harness {t.harness_version}):"]
    for name, row in t.rows().items():
        n = row.examples
        metrics = ", ".join(f"{m} {v.value:.4f}" + (f" ± {v.stderr:.4f}" if v.stderr is not None else "")
                            for m, v in row.metrics.items())
        lines.append(f"  {name}{f' ({n} examples)' if n else ''}: {metrics}")
    return lines


TASKS = register(Measurement(
    name="tasks", heading="Tasks (lm-evaluation-harness)", asked_by="--tasks", flags=TasksFlags, settings=settings,
    record=TasksResult, run=run, prepare=prepare, inputs=inputs, summary=summary, builtin=True))
