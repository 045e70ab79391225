"""One `gqakit eval` run as a function: check, load, measure, assemble the EvalResult (eval/records.py).

Kept apart from the click layer so the demo, the bench scripts and tests call it directly:
`run_eval` takes the settings the CLI built (PerplexitySettings, SpeedSettings,
TaskSettings), and `perplexity_of_file` is "load a model, then the perplexity of a text".
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit.core.device import check_device, resolve_device
from gqakit.core.errors import GqakitError
from gqakit.core.hub import resolve_model_ref
from gqakit.core.text import EvalText, TextSource
from gqakit.core.run import current, running
from gqakit.core.units import COMPUTE_DTYPES, dtype_named, torch_dtype
from gqakit.eval.perplexity import PerplexitySettings
from gqakit.eval.provenance import model_info, run_info
from gqakit.eval.records import SCHEMA, EvalResult, HubInfo, write_results

if TYPE_CHECKING:
    from gqakit.eval.perplexity_seq2seq import Examples
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


def check_eval_inputs(model_path: str | Path, *, perplexity: PerplexitySettings | None, speed: SpeedSettings | None,
                      tasks: TaskSettings | None, device: str | None, dtype: str | None, out: Path | None,
                      overwrite: bool) -> Path | None:
    """Every check that needs no torch and no loaded model; returns OUT resolved. Writes nothing.

    The settings were checked when they were built (PerplexitySettings, SpeedSettings,
    TaskSettings); here: that there is something to measure, the model, device, dtype and OUT."""
    from gqakit.core.loading import is_encoder_decoder, split_source
    from gqakit.core.outrule import RESULTS, check_output_path

    if perplexity is None and speed is None and tasks is None:
        raise GqakitError("nothing to measure: pass --data (perplexity), --speed, --tasks, or several")
    split_source(model_path)  # a missing path or a broken config.json, before anything slow
    if speed is not None:  # a grid axis given for the other kind of model
        speed.check_model(is_encoder_decoder(model_path))
        check_speed_positions(model_path)
    check_device(device)
    check_dtype(dtype)
    if out is None:
        return None
    return check_output_path(Path(out), overwrite=overwrite, inputs=eval_inputs(model_path, perplexity, tasks),
                             kind=RESULTS, flag="--out")


def check_speed_positions(model_path: str | Path) -> None:
    """Decode speed is timed on a preallocated (static) KV cache, whose mask transformers'
    ALiBi models cannot take: their bias spans the tokens seen so far. Refused before loading."""
    from gqakit.core.arch import find
    from gqakit.core.loading import read_config_json, split_source

    folder, gguf = split_source(model_path)
    config = {} if gguf else read_config_json(folder)
    spec = find(config)
    if spec is not None and spec.uses_alibi(config):
        raise GqakitError(f"--speed: this {spec.family} model uses ALiBi position biases, which transformers "
                          "cannot apply over the static KV cache the speed grid times; measure perplexity or tasks")


def eval_inputs(model_path: str | Path, perplexity: PerplexitySettings | None,
                tasks: TaskSettings | None) -> list[tuple[str, Any]]:
    """What OUT must never be, nor be inside: the model, the data file, the tasks folder."""
    inputs: list[tuple[str, Any]] = [("model", model_path)]
    if perplexity is not None and perplexity.data.file is not None:
        inputs.append(("data file", perplexity.data.file))
    if tasks is not None and tasks.tasks_path is not None:
        inputs.append(("tasks folder", tasks.tasks_path))
    return inputs


def run_eval(model_path: str | Path, *, perplexity: PerplexitySettings | None = None, speed: SpeedSettings | None = None,
             tasks: TaskSettings | None = None, device: str | None = None, dtype: str | None = None,
             out: Path | None = None, command: list[str] | None = None, progress: bool = True,
             overwrite: bool = False, quiet: bool = False) -> EvalResult:
    """Measure perplexity, decode speed and/or task accuracy of one model; write `out` if given.

    Each measurement runs when its settings are given: `perplexity` (eval.perplexity), `speed`
    (eval.speed.SpeedSettings), `tasks` (eval.tasks.TaskSettings: lm-evaluation-harness
    tasks run on the loaded model).

    Every input is checked before the model is loaded, and OUT before anything runs: an
    existing file is replaced only with `overwrite`, and only when it is a gqakit results
    file; OUT is never the model, the data, or inside either.
    """
    ref = resolve_model_ref(model_path)  # a Hub id: its snapshot in the Hugging Face cache
    model_path = ref.path if ref.repo_id else model_path
    out = check_eval_inputs(model_path, perplexity=perplexity, speed=speed, tasks=tasks, device=device, dtype=dtype,
                            out=out, overwrite=overwrite)
    from gqakit.core.loading import encoder_input, is_encoder_decoder
    from gqakit.core.quiet import quiet_libraries

    doc, pairs = None, None
    encoder_decoder = is_encoder_decoder(model_path)
    features = encoder_decoder and encoder_input(model_path) == "features"
    if perplexity is not None and features:
        from gqakit.core.pairs import read_feature_pairs

        perplexity.objective_for(encoder_decoder, model_path, features=True)  # the data's kind, in one line
        pairs = read_feature_pairs(perplexity.data.spec, input_field=perplexity.input_field,
                                   target_field=perplexity.target_field)
    elif perplexity is not None and perplexity.objective == "paired":
        from gqakit.core.pairs import is_feature_file, read_pairs

        if is_feature_file(perplexity.data.spec):  # audio features for a model that reads text: one line
            perplexity.objective_for(encoder_decoder, model_path)
        pairs = read_pairs(perplexity.data.spec, input_field=perplexity.input_field,
                           target_field=perplexity.target_field)
    elif perplexity is not None:
        doc = perplexity.read()  # fail on bad data before loading
    objective = (perplexity.objective_for(encoder_decoder, model_path, features=features)
                 if perplexity is not None else None)
    if tasks is not None:
        from gqakit.eval.tasks import check_seq2seq_tasks, check_tasks, load_tasks

        check_tasks(tasks, quiet=quiet)  # harness installed, names known, local data present: before loading
        with quiet_libraries(quiet):
            load_tasks(tasks, quiet=quiet)  # their datasets read (offline) before the model loads
        if encoder_decoder:
            check_seq2seq_tasks(tasks)
    examples = None
    if objective in ("span_corruption", "paired"):
        from gqakit.core.loading import load_tokenizer
        from gqakit.eval.perplexity_seq2seq import prepare_feature_pairs, prepare_paired, prepare_span_corruption

        with quiet_libraries(quiet):  # tokenized (and span-corrupted) before the model loads
            tok = load_tokenizer(model_path)
            if features:
                doc, examples = pairs.doc, prepare_feature_pairs(tok, pairs)
            elif pairs is not None:
                doc, examples = pairs.doc, prepare_paired(tok, pairs, perplexity)
            else:
                examples = prepare_span_corruption(tok, doc, perplexity, model_path)
    seen = seen_in_training(model_path, doc) if doc is not None else []

    with quiet_libraries(quiet), running(progress=progress, quiet=quiet):
        results = measure(model_path, doc, perplexity=perplexity, speed=speed, tasks=tasks, device=device,
                          dtype=dtype, command=command, examples=examples, encoder_decoder=encoder_decoder)
    if ref.repo_id:  # recorded by its Hub id, not by a path inside the cache
        results.model.path, results.model.hub = ref.name, HubInfo(**ref.record())
    if seen:
        results.perplexity.data["seen_in_training"] = seen
        if not quiet:
            import click

            click.echo(f"gqakit: warning: the evaluation text is part of {seen[0]['file']}, which this model was "
                       f"trained on ({seen[0]['as']}): its perplexity is not a held-out number", err=True)
    if out is not None:
        from gqakit.core.outrule import RESULTS, check_output_path

        # again: the file may have appeared while the model ran
        check_output_path(out, overwrite=overwrite, inputs=eval_inputs(model_path, perplexity, tasks), kind=RESULTS,
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


def measure(model_path: str | Path, doc: EvalText | None, *, perplexity: PerplexitySettings | None = None,
            speed: SpeedSettings | None = None, tasks: TaskSettings | None = None, device: str | None = None,
            dtype: str | None = None, command: list[str] | None = None, examples: Examples | None = None,
            encoder_decoder: bool | None = None) -> EvalResult:
    """Load the model once and run each measurement whose settings are given (inputs already checked).
    An encoder-decoder's perplexity scores `examples` (eval.perplexity_seq2seq.prepare_*), a decoder's `doc`.
    Bars and messages follow the run context (`core.run`) that `run_eval` set."""
    import torch

    from gqakit.core.loading import is_encoder_decoder, load_causal_lm, load_seq2seq_lm, load_tokenizer

    progress, quiet = current().progress, current().quiet
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if encoder_decoder is None:
        encoder_decoder = is_encoder_decoder(model_path)
    model = (load_seq2seq_lm if encoder_decoder else load_causal_lm)(model_path, dtype=dt, device=dev)
    info = model_info(model, model_path, torch.finfo(dt).bits // 8)
    results = EvalResult(schema=SCHEMA, run=run_info(command=command, device=dev, dtype=dt), model=info)
    if perplexity is not None and examples is not None:
        from gqakit.eval.perplexity_seq2seq import score

        # learned positions (BART) limit the lengths; T5's relative ones (its n_positions is nominal) do not
        learned = hasattr(model.get_encoder(), "embed_positions")
        results.perplexity = score(model, examples, device=dev, max_positions=info.max_positions if learned else None,
                                   progress=progress)
    elif perplexity is not None and doc is not None:
        from gqakit.eval.perplexity import evaluate_perplexity

        tok = load_tokenizer(model_path)
        results.perplexity = evaluate_perplexity(model, tok, doc, perplexity.window, device=dev,
                                                 max_positions=info.max_positions, progress=progress)
    if speed is not None:
        from gqakit.eval.speed import evaluate_speed

        results.speed = evaluate_speed(model, speed, device=dev, dtype=dt, max_positions=info.max_positions,
                                       progress=progress)
    if tasks is not None:
        from gqakit.eval.tasks import run_tasks

        results.tasks = run_tasks(model, load_tokenizer(model_path), tasks, progress=progress, quiet=quiet)
    return results


def seen_in_training(model_path: str | Path, doc: EvalText) -> list[dict[str, str]]:
    """Files the model's own records say it was trained or calibrated on that hold the
    evaluation text (equal content, or the text as a part): recorded with the result.

    Reads `gqakit_uptrain.yaml` (data.files) and `gqakit_convert.json` (calibration data)
    of a gqakit model folder; files that are gone or larger than 2 GB are skipped."""
    from gqakit.core.convrecord import read_conversion_record
    from gqakit.core.globs import bounded_glob

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
                       for f in bounded_glob(pat)[0]]  # a folder's own record: no walk of the whole disk
        conv = read_conversion_record(folder)
        calib = conv.settings.calibration_data if conv is not None else None
        if calib is not None and not TextSource(calib).is_dataset:
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
