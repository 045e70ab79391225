"""One `gqakit eval` run as a function: load, measure, assemble the EvalResult (eval/records.py).

Kept apart from the click layer so the demo and tests call it directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gqakit.core.device import check_device, resolve_device  # noqa: F401  (re-exported)
from gqakit.core.errors import GqakitError
from gqakit.eval.records import EvalResult
from gqakit.eval.results import SCHEMA, model_info, run_info, write_results

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
def resolve_dtype(dtype: str | None, device: str) -> Any:
    """float32 on CPU (half is slow there), bfloat16 on GPU, unless told otherwise."""
    import torch

    check_dtype(dtype)
    if dtype in (None, "auto"):
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, DTYPES[dtype])


def check_dtype(dtype: str | None) -> None:
    if dtype not in (None, "auto") and dtype not in DTYPES:
        raise GqakitError(f"--dtype must be one of auto, {', '.join(sorted(set(DTYPES)))}; got {dtype!r}")


def check_eval_inputs(model_path: str | Path, *, data: str | None, ppl: bool, speed: bool, context: int,
                      stride: int | None, max_chars: int | None, device: str | None, dtype: str | None,
                      out: Path | None, overwrite: bool, tasks: Any = None) -> Path | None:
    """Every check that needs no torch and no loaded model; returns OUT resolved. Writes nothing."""
    from gqakit.core.loading import split_source
    from gqakit.core.outdir import RESULTS, check_output_path

    if not ppl and not speed and not tasks:
        raise GqakitError("nothing to measure: pass --data (perplexity), --speed, --tasks, or several")
    if ppl and not data:
        raise GqakitError("--ppl needs --data FILE (or hf:NAME[:CONFIG][:SPLIT])")
    split_source(model_path)  # a missing path or a broken config.json, before anything slow
    if ppl:
        if context < 2:
            raise GqakitError(f"--context must be at least 2 tokens (got {context})")
        if stride is not None and not 1 <= stride <= context:
            raise GqakitError(f"--stride must be between 1 and --context ({context}); got {stride}")
        if max_chars is not None and max_chars < 1:
            raise GqakitError(f"--max-chars must be a positive number of characters; got {max_chars}")
    check_device(device)
    check_dtype(dtype)
    if out is None:
        return None
    inputs = [("model", model_path)]
    if ppl and data and not data.startswith("hf:"):
        inputs.append(("data file", data))
    if tasks is not None and tasks.tasks_path is not None:
        inputs.append(("tasks folder", tasks.tasks_path))
    return check_output_path(Path(out), overwrite=overwrite, inputs=inputs, kind=RESULTS, flag="--out")


def run_eval(model_path: str | Path, *, data: str | None = None, ppl: bool = True, speed: bool = False,
             context: int = 512, stride: int | None = None, max_chars: int | None = None,
             text_field: str = "text", speed_settings: Any = None, device: str | None = None,
             dtype: str | None = None, out: Path | None = None, command: list[str] | None = None,
             progress: bool = True, overwrite: bool = False, quiet: bool = False,
             tasks: Any = None) -> EvalResult:
    """Measure perplexity, decode speed and/or task accuracy of one model; write `out` if given.

    `tasks` is an eval.tasks.TaskSettings: lm-evaluation-harness tasks run on the loaded model.

    Every input is checked before the model is loaded, and OUT before anything runs: an
    existing file is replaced only with `overwrite`, and only when it is a gqakit results
    file; OUT is never the model, the data, or inside either.
    """
    out = check_eval_inputs(model_path, data=data, ppl=ppl, speed=speed, context=context, stride=stride,
                            max_chars=max_chars, device=device, dtype=dtype, out=out, overwrite=overwrite,
                            tasks=tasks)
    from gqakit.core.quiet import quiet_libraries

    if tasks is not None:
        from gqakit.eval.tasks import check_tasks, load_tasks

        check_tasks(tasks, quiet=quiet)  # harness installed, names known, local data present: before loading
        with quiet_libraries(quiet):
            load_tasks(tasks, quiet=quiet)  # their datasets read (offline) before the model loads
    doc = None
    if ppl:
        from gqakit.eval.perplexity import read_text

        doc = read_text(data, max_chars=max_chars, text_field=text_field)  # fail on bad data before loading
    seen = seen_in_training(model_path, doc) if doc is not None else []

    with quiet_libraries(quiet):
        results = _measure(model_path, doc, ppl=ppl, speed=speed, context=context, stride=stride,
                           speed_settings=speed_settings, device=device, dtype=dtype, command=command,
                           progress=progress and not quiet, tasks=tasks, quiet=quiet)
    if seen:
        results.perplexity.data["seen_in_training"] = seen
        if not quiet:
            import click

            click.echo(f"gqakit: warning: the evaluation text is part of {seen[0]['file']}, which this model was "
                       f"trained on ({seen[0]['as']}): its perplexity is not a held-out number", err=True)
    if out is not None:
        from gqakit.core.outdir import RESULTS, check_output_path

        # again: the file may have appeared while the model ran
        inputs = [("model", model_path)] + ([("data file", data)] if doc is not None and not data.startswith("hf:") else [])
        inputs += [("tasks folder", tasks.tasks_path)] if tasks is not None and tasks.tasks_path is not None else []
        check_output_path(out, overwrite=overwrite, inputs=inputs, kind=RESULTS, flag="--out")
        write_results(results, Path(out))
    return results


def _measure(model_path: str | Path, doc: Any, *, ppl: bool, speed: bool, context: int, stride: int | None,
             speed_settings: Any, device: str | None, dtype: str | None, command: list[str] | None,
             progress: bool, tasks: Any = None, quiet: bool = False) -> EvalResult:
    import torch

    from gqakit.core.loading import load_causal_lm, load_tokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model = load_causal_lm(model_path, dtype=dt, device=dev)
    info = model_info(model, model_path, torch.finfo(dt).bits // 8)
    results = EvalResult(schema=SCHEMA, run=run_info(command=command, device=dev, dtype=dt), model=info)
    if ppl:
        from gqakit.eval.perplexity import evaluate_perplexity

        tok = load_tokenizer(model_path)
        results.perplexity = evaluate_perplexity(model, tok, doc, context=context, stride=stride, device=dev,
                                                 max_positions=info.max_positions, progress=progress)
    if speed:
        from gqakit.eval.speed import SpeedSettings, evaluate_speed

        results.speed = evaluate_speed(model, speed_settings or SpeedSettings(), device=dev, dtype=dt,
                                       max_positions=info.max_positions, progress=progress)
    if tasks is not None:
        from gqakit.eval.tasks import run_tasks

        results.tasks = run_tasks(model, load_tokenizer(model_path), tasks, progress=progress, quiet=quiet)
    return results


def seen_in_training(model_path: str | Path, doc: Any) -> list[dict[str, str]]:
    """Files the model's own records say it was trained or calibrated on that hold the
    evaluation text (equal content, or the text as a part): recorded with the result.

    Reads `gqakit_uptrain.yaml` (data.files) and `gqakit_convert.json` (calibration data)
    of a gqakit model folder; files that are gone or larger than 2 GB are skipped."""
    import glob
    import json

    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        return []
    candidates: list[tuple[str, str]] = []
    try:
        import yaml

        from gqakit.core.yamlfile import read_yaml  # limits: a hostile file is skipped, not a hang

        up = read_yaml(folder / "gqakit_uptrain.yaml") if (folder / "gqakit_uptrain.yaml").is_file() else {}
        pats = (((up or {}).get("settings") or {}).get("data") or {}).get("files") or []
        candidates += [(f, "uptrain data.files") for pat in pats if isinstance(pat, str)
                       for f in sorted(glob.glob(str(Path(pat).expanduser()), recursive=True))]
        conv = json.loads((folder / "gqakit_convert.json").read_text()) if (folder / "gqakit_convert.json").is_file() else {}
        calib = ((conv or {}).get("settings") or {}).get("calibration_data")
        if isinstance(calib, str):
            candidates.append((calib, "convert --calibration-data"))
    except (OSError, ValueError, AttributeError, TypeError, yaml.YAMLError):
        return []
    needle = doc.text.strip()
    found = []
    for f, what in dict.fromkeys(candidates):
        p = Path(f)
        try:
            if not p.is_file() or p.stat().st_size > 2 << 30:
                continue
            text = p.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        except OSError:
            continue
        if needle and needle in text:
            found.append({"file": str(p.resolve()), "as": what})
    return found
