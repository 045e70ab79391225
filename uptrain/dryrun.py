"""`gqakit uptrain CONFIG --dry-run`: every check a run makes before its first step, with
every problem reported at once, the schedule and the memory plan. Nothing is written and
no weights are loaded (tokenizers and config.json files are).

What it checks, in order: the config (one line: nothing else can be read from a config
that does not validate), then everything `preflight` checks (model, teacher, data files,
sizes, the run folder, `--resume`), the tokenizer (it loads, matches the teacher's, has
the sentinels span corruption needs), the schedule against the budget (at least one
optimizer step; a warm-up too long for the run is scaled and said), and the memory plan
(it fits the device). The resolved config and the plan go to stdout as YAML with comments;
each problem is one `gqakit: error:` line on stderr, and the exit status is 0 only when a
run with the same arguments would start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError
from gqakit.uptrain.config import to_yaml
from gqakit.uptrain.preflight import Checked, Problems, model_source, preflight, same_tokenizer
from gqakit.uptrain.schedule import resolve_warmup, steps as n_steps, total_steps


def _check_tokenizer(checked: Checked) -> None:
    from gqakit.core.loading import load_tokenizer

    tokenizer = load_tokenizer(checked.src)
    if checked.teacher is not None and not same_tokenizer(tokenizer, load_tokenizer(checked.teacher)):
        raise GqakitError(f"teacher.path: the tokenizer of {checked.teacher} differs from the model's")
    if checked.cfg.data.objective == "span_corruption":
        from gqakit.core.spans import sentinel_ids

        sentinel_ids(tokenizer)


def _schedule(checked: Checked, processes: int) -> list[str]:
    """The schedule's lines; a budget under one optimizer step is a problem (raised)."""
    t = checked.cfg.train
    per_step = t.micro_batch * t.grad_accum * processes * t.seq_len
    total = total_steps(t, per_step)
    warmup, scaled = resolve_warmup(t, total)
    decay = f"cosine to {t.lr * t.min_lr_ratio:g}" if t.decay == "cosine" else "constant"
    lines = [f"schedule: {n_steps(total)} of {per_step:,} tokens ({processes} process"
             f"{'es' if processes > 1 else ''}), warm-up {n_steps(warmup)} to lr {t.lr:g}, then {decay}"]
    return lines + ([scaled] if scaled else [])


def _plan(checked: Checked, device_memory: Sequence[str], accelerate_config: str | None) -> tuple[list[str], bool]:
    from gqakit.uptrain.plan import plan_for_config

    cfg = checked.cfg
    src = checked.src or model_source(cfg.model.path, "model.path")
    return plan_for_config(cfg, device_memory=device_memory, accelerate_config=accelerate_config, src=src,
                           teacher=checked.teacher)


def dry_run(config: Any, overrides: Sequence[str], *, device_memory: Sequence[str] = (),
            accelerate_config: str | None = None, resume: bool = False, overwrite: bool = False,
            echo: Callable[[str], None] = print) -> list[str]:
    """Print the resolved config, the schedule and the plan through ECHO; return the problems
    (empty when a run would start). A bad option or config raises at once."""
    from gqakit.uptrain.plan import device_memory_size, target_from_accelerate_config, target_from_environment

    for m in device_memory:
        device_memory_size(m)  # a bad size is one line before anything is printed
    target = target_from_accelerate_config(accelerate_config, "cuda") if accelerate_config else \
        target_from_environment("cuda")
    problems = Problems()
    checked = preflight(config, overrides, overwrite=overwrite, resume=resume, problems=problems)
    cfg = checked.cfg
    echo(to_yaml(cfg).rstrip("\n"))
    if checked.src is not None:
        problems.run(_check_tokenizer, checked)
    schedule = problems.run(_schedule, checked, target.processes)
    notes = list(schedule or [])
    teacher_refused = bool(cfg.teacher.path) and checked.teacher is None
    has_config = (model_source(cfg.model.path, "model.path") / "config.json").is_file()
    if teacher_refused or not has_config:
        why = "model.path" if not has_config else "teacher.path"
        notes.append(f"memory plan: none; {why} was refused")
    else:
        plan = problems.run(_plan, checked, device_memory, accelerate_config)
        if plan is not None:
            lines, fits = plan
            notes += lines
            if not fits:
                problems.found.append("the plan does not fit any device named; " + lines[-1].split("; ", 1)[-1])
    echo("\n".join("# " + ln for ln in notes))
    return problems.found


def report(problems: list[str], echo_err: Callable[[str], None]) -> None:
    """Each problem on its own `gqakit: error:` line; the last one is raised (exit status 2)."""
    if not problems:
        return
    for p in problems[:-1]:
        echo_err(f"gqakit: error: {p}")
    raise GqakitError(problems[-1])
