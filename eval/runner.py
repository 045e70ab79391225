"""One `gqakit eval` run as a function: check, load, measure, assemble the EvalResult (eval/records.py).

Kept apart from the click layer so the demo, the bench scripts and tests call it directly:
`run_eval` takes the settings the CLI built, one per registered measurement asked for
(eval/measurement.py: PerplexitySettings, SpeedSettings, TaskSettings, and any other
registered one's), and `perplexity_of_file` is "load a model, then the perplexity of a text".
Each measurement's own hooks do its checks, its reading before the model loads, and its run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit.core.device import check_device, resolve_device
from gqakit.core.errors import GqakitError
from gqakit.core.hub import resolve_model_ref
from gqakit.core.run import running
from gqakit.core.units import COMPUTE_DTYPES, dtype_named, torch_dtype
from gqakit.eval.perplexity import PerplexitySettings
from gqakit.eval.provenance import model_info, run_info
from gqakit.eval.measurement import Context
from gqakit.eval.measures import measurements, nothing_to_measure
from gqakit.eval.records import HubInfo
from gqakit.eval.results import SCHEMA, EvalResult, write_results

if TYPE_CHECKING:
    from gqakit.eval.speed import SpeedSettings
    from gqakit.eval.tasks import TaskSettings

# The names --dtype accepts: each compute dtype and its short alias (bf16, fp16, fp32).
DTYPES = tuple(n for d in COMPUTE_DTYPES for n in (d, *dtype_named(d).aliases))


def resolve_dtype(dtype: str | None, device: str) -> Any:
    """float32 on CPU (half is slow there), bfloat16 on GPU, unless told otherwise."""
    import torch

    check_dtype(dtype)
    if dtype in (None, "auto"):
        return torch.float32 if device == "cpu" else torch.bfloat16
    return torch_dtype(dtype)


def check_dtype(dtype: str | None) -> None:
    if dtype not in (None, "auto") and dtype not in DTYPES:
        raise GqakitError(f"--dtype must be one of auto, {', '.join(sorted(set(DTYPES)))}; got {dtype!r}")


def asked(perplexity: Any = None, speed: Any = None, tasks: Any = None,
          others: dict[str, Any] | None = None) -> dict[str, Any]:
    """{name: settings} of the measurements asked for, in the registry's order."""
    given = {"perplexity": perplexity, "speed": speed, "tasks": tasks, **(others or {})}
    registry = measurements()
    unknown = [n for n in given if n not in registry]
    if unknown:
        raise GqakitError(f"no measurement named {unknown[0]!r}; registered: {', '.join(registry)}")
    return {n: given[n] for n in registry if given.get(n) is not None}


def check_eval_inputs(model_path: str | Path, *, perplexity: PerplexitySettings | None = None,
                      speed: SpeedSettings | None = None, tasks: TaskSettings | None = None,
                      device: str | None, dtype: str | None, out: Path | None, overwrite: bool,
                      measures: dict[str, Any] | None = None) -> Path | None:
    """Every check that needs no torch and no loaded model; returns OUT resolved. Writes nothing.

    The settings were checked when they were built; here: that there is something to measure
    (`measures`: {name: settings}, or the three built-in keywords), each measurement's own
    `check`, the model, device, dtype and OUT."""
    from gqakit.core.loading import is_encoder_decoder, split_source
    from gqakit.core.outrule import RESULTS, check_output_path

    measures = asked(perplexity, speed, tasks) if measures is None else measures
    if not measures:
        raise GqakitError(nothing_to_measure())
    split_source(model_path)  # a missing path or a broken config.json, before anything slow
    registry = measurements()
    checks = [(registry[n].check, s) for n, s in measures.items() if registry[n].check is not None]
    if checks:
        encoder_decoder = is_encoder_decoder(model_path)
        for check, s in checks:
            check(s, model_path, encoder_decoder)
    check_device(device)
    check_dtype(dtype)
    if out is None:
        return None
    return check_output_path(Path(out), overwrite=overwrite, inputs=eval_inputs(model_path, measures),
                             kind=RESULTS, flag="--out")


def eval_inputs(model_path: str | Path, measures: dict[str, Any]) -> list[tuple[str, Any]]:
    """What OUT must never be, nor be inside: the model, and each measurement's inputs (the
    data file, the tasks folder)."""
    registry = measurements()
    inputs: list[tuple[str, Any]] = [("model", model_path)]
    for n, s in measures.items():
        if registry[n].inputs is not None:
            inputs += registry[n].inputs(s)
    return inputs


def run_eval(model_path: str | Path, *, perplexity: PerplexitySettings | None = None, speed: SpeedSettings | None = None,
             tasks: TaskSettings | None = None, measures: dict[str, Any] | None = None, device: str | None = None,
             dtype: str | None = None, out: Path | None = None, command: list[str] | None = None,
             progress: bool = True, overwrite: bool = False, quiet: bool = False) -> EvalResult:
    """Measure perplexity, decode speed, task accuracy and/or any registered measurement of
    one model; write `out` if given.

    Each measurement runs when its settings are given: `perplexity` (eval.perplexity), `speed`
    (eval.speed.SpeedSettings), `tasks` (eval.tasks.TaskSettings: lm-evaluation-harness
    tasks run on the loaded model), or `measures={name: settings}` for any registered one
    (eval/measurement.py), the built-in ones included.

    Every input is checked before the model is loaded, and OUT before anything runs: an
    existing file is replaced only with `overwrite`, and only when it is a gqakit results
    file; OUT is never the model, the data, or inside either.
    """
    ref = resolve_model_ref(model_path)  # a Hub id: its snapshot in the Hugging Face cache
    model_path = ref.path if ref.repo_id else model_path
    measures = asked(perplexity, speed, tasks, measures)
    out = check_eval_inputs(model_path, device=device, dtype=dtype, out=out, overwrite=overwrite, measures=measures)
    from gqakit.core.loading import is_encoder_decoder
    from gqakit.core.quiet import quiet_libraries

    registry = measurements()
    encoder_decoder = is_encoder_decoder(model_path)
    prepared = {n: registry[n].prepare(s, model_path, encoder_decoder, quiet) if registry[n].prepare else None
                for n, s in measures.items()}  # data read and tokenized before the model loads
    with quiet_libraries(quiet), running(progress=progress, quiet=quiet):
        results = measure(model_path, measures, prepared, device=device, dtype=dtype, command=command,
                          progress=progress and not quiet, quiet=quiet, encoder_decoder=encoder_decoder)
    if ref.repo_id:  # recorded by its Hub id, not by a path inside the cache
        results.model.path, results.model.hub = ref.name, HubInfo(**ref.record())
    for n in measures:
        if registry[n].done is not None:
            registry[n].done(results.block(n), prepared[n], quiet)
    if out is not None:
        from gqakit.core.outrule import RESULTS, check_output_path

        # again: the file may have appeared while the model ran
        check_output_path(out, overwrite=overwrite, inputs=eval_inputs(model_path, measures), kind=RESULTS,
                          flag="--out")
        write_results(results, Path(out))
    return results


def perplexity_of_file(model_path: str | Path, settings: PerplexitySettings, *, device: str | None = None,
                       dtype: str | None = None, command: list[str] | None = None, progress: bool = False,
                       quiet: bool = False) -> EvalResult:
    """Load MODEL, then the perplexity of `settings.data`: the `run`, `model` and `perplexity`
    blocks of a results file, nothing written (`gqakit eval MODEL --data FILE` without --out).

    `perplexity_of_file(path, PerplexitySettings(data=FILE)).perplexity.token_perplexity`
    is the one number most callers want."""
    return run_eval(model_path, perplexity=settings, device=device, dtype=dtype, command=command, progress=progress,
                    quiet=quiet)


def measure(model_path: str | Path, measures: dict[str, Any], prepared: dict[str, Any], *,
            device: str | None = None, dtype: str | None = None, command: list[str] | None = None,
            progress: bool = True, quiet: bool = False, encoder_decoder: bool | None = None) -> EvalResult:
    """Load the model once and run each measurement of `measures` ({name: settings}, inputs
    already checked; `prepared`: what each one's `prepare` returned), its block set by its name."""
    import torch

    from gqakit.core.loading import is_encoder_decoder, load_causal_lm, load_seq2seq_lm

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if encoder_decoder is None:
        encoder_decoder = is_encoder_decoder(model_path)
    from gqakit.engines.llamacpp_ref import per_layer_gguf, reference_model

    if not encoder_decoder and per_layer_gguf(model_path):  # transformers has no class for it: gqakit reads it
        model = reference_model(model_path, dtype=dt, device=dev)
    else:
        model = (load_seq2seq_lm if encoder_decoder else load_causal_lm)(model_path, dtype=dt, device=dev)
    info = model_info(model, model_path, torch.finfo(dt).bits // 8)
    results = EvalResult(schema=SCHEMA, run=run_info(command=command, device=dev, dtype=dt), model=info)
    ctx = Context(model=model, model_path=model_path, device=dev, dtype=dt, info=info,
                  encoder_decoder=encoder_decoder, progress=progress, quiet=quiet)
    registry = measurements()
    for n, s in measures.items():
        results.set_block(n, registry[n].run(ctx, s, prepared.get(n)))
    return results
