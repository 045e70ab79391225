"""A conversion, end to end: stream the plan into the writer.

    ConvertSettings --check the output rule--> open SRC (`source`, or `gguf_in` for a
      .gguf OUT) --make_plan--> Plan --> for each step, in file order: pass the tensor
      through, or write the layer's converted attention, which comes from the method
      (layer by layer, from the weights) or from the calibration stage (block by block)
      --> the writer: shards in a model folder (`io.ShardWriter`) or one GGUF file
      (`gguf_out.GGUFWriter`) --> the record (`record`) --> atomic rename to OUT

`convert_folder` and `convert_gguf_file` take the settings built once (by the CLI);
`convert_checkpoint` and `convert_gguf` build them from keyword arguments (Python API).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import gqakit
from gqakit.convert.budget.choose import choose_for, with_choice
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.io import ShardWriter, copied_from, copy_tensor
from gqakit.convert.layout import AttnHeads, read_heads, write_heads
from gqakit.convert.methods import method_function
from gqakit.convert.plan import AttentionLayer, Plan, make_plan, trained_block_tensors
from gqakit.convert.pooling import PoolContext
from gqakit.convert.record import drift_summary, write_metadata
from gqakit.convert.resolved import ResolvedSettings
from gqakit.convert.settings import DEFAULT_CALIBRATION_TOKENS, DEFAULT_METHOD, ConvertSettings
from gqakit.convert.source import Opened, open_model
from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError
from gqakit.core.outdir import RESUME_DIR, atomic_output_dir, atomic_output_file, resumable_output_dir
from gqakit.core.outrule import GGUF_FILE, check_output_path
from gqakit.core.run import progress_as, show_bars

Layers = Iterator[tuple[int, AttnHeads]]
Steps = Iterator[tuple[AttentionLayer, AttnHeads]]


def convert_checkpoint(src: str | Path, out: str | Path, num_kv_heads: int, method: str = DEFAULT_METHOD, *,
                       grouping: str = "auto", effort: str = "best", dtype: str = "auto", overwrite: bool = False,
                       max_shard_size: str | int = "2GB", seed: int = 0, calibration_data: str | None = None,
                       calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS, options: dict[str, Any] | None = None,
                       device: str = "auto", progress: bool | None = None, group_encoder: bool = False,
                       force: bool = True) -> Path:
    """Convert SRC (HF folder or .gguf) to the model folder OUT with `num_kv_heads` K/V heads
    per layer: `convert_folder` with the settings built from these arguments. `force` (unlike
    the CLI's --force, on by default) lets `num_kv_heads` equal SRC's KV heads: the exact copy
    that checks a method and a layout end to end. `progress`: bars and messages (None: as the
    run context says, `core.run`)."""
    settings = ConvertSettings(source=src, num_kv_heads=num_kv_heads, method=method, grouping=grouping, effort=effort,
                               dtype=dtype,
                               max_shard_size=max_shard_size, seed=seed, calibration_data=calibration_data,
                               calibration_tokens=calibration_tokens, refit=options or {},
                               group_encoder=group_encoder, force=force)
    with progress_as(progress):
        return convert_folder(settings, out, overwrite=overwrite, device=device)


def convert_gguf(src: str | Path, out: str | Path, num_kv_heads: int, method: str = DEFAULT_METHOD, *,
                 grouping: str = "auto", effort: str = "best", gguf_type: str | None = None, overwrite: bool = False,
                 seed: int = 0,
                 calibration_data: str | None = None, calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
                 options: dict[str, Any] | None = None, device: str = "auto", progress: bool | None = None,
                 dry_run: bool = False, force: bool = True) -> Path | list[str]:
    """Convert SRC.gguf to OUT.gguf with `num_kv_heads` KV heads: `convert_gguf_file` with the
    settings built from these arguments (`force` as in `convert_checkpoint`)."""
    settings = ConvertSettings(source=src, num_kv_heads=num_kv_heads, method=method, grouping=grouping, effort=effort,
                               seed=seed,
                               calibration_data=calibration_data, calibration_tokens=calibration_tokens,
                               refit=options or {}, max_shard_size=None, force=force)
    with progress_as(progress):
        return convert_gguf_file(settings, out, gguf_type=gguf_type, overwrite=overwrite, device=device,
                                 dry_run=dry_run)


def dry_run_lines(settings: ConvertSettings, *, device: str = "auto", out: str | Path | None = None,
                  overwrite: bool = False) -> list[str]:
    """What `convert_folder` would do, as lines of text; nothing is written. With `out`, the
    output rule is checked too, as the run would."""
    from gqakit.core.device import resolve_device

    dev = resolve_device(device) if settings.staged else "cpu"
    if out is not None:
        check_output_path(Path(out), overwrite=overwrite,
                          inputs=[("source", Path(settings.source)), ("calibration data", settings.calibration_file)])
    opened = open_model(settings.source)
    settings, choice = choose_for(opened, settings, device=dev, progress=show_bars())
    plan = make_plan(opened, settings, device=dev, kv_heads=None if choice is None else choice.kv_heads)
    plan.settings = with_choice(plan.settings, choice)
    s, r = plan.shape, plan.settings
    grouped = [f"grouped: {', '.join(plan.grouped)}"] if plan.is_encoder_decoder else []
    before = list(s.kv_heads_per_layer) if s.kv_heads_per_layer else s.num_kv_heads
    return [f"{plan.family}: {s.num_layers} {'decoder ' if grouped else ''}layers, {s.num_heads} query heads, "
            f"{before} -> {list(r.kv_heads) if r.kv_heads else r.num_kv_heads} KV heads, head_dim {s.head_dim}",
            *grouped, *auto_lines(plan.settings), *(choice.lines() if choice is not None else ()),
            *expected_time_lines(opened, plan, dev),
            f"parameters {plan.source_params:,} -> {plan.output_params:,}; "
            f"{len(plan.tensors)} tensors; method {settings.method}; nothing written (dry run)"]


def expected_time_lines(opened: Opened, plan: Plan, device: str) -> list[str]:
    """For a method that calibrates: its expected time on `device`, from a short probe of the
    first layer (`calibration.estimate`); none for the others."""
    if not plan.settings.staged:
        return []
    from gqakit.convert.calibration.probe import estimate_line

    return [estimate_line(opened, plan, plan.settings, device=device)]


def auto_lines(settings: ResolvedSettings) -> list[str]:
    """One line on what the resolved settings' "auto" values are, or none."""
    reasons = settings.auto_reasons()
    return [f"{settings.method} settings: " + "; ".join(f"{k} {v}" for k, v in reasons.items())] if reasons else []


# ----------------------------------------------------------------------------- where the layers come from

def per_step_heads(opened: Opened, plan: Plan, settings: ResolvedSettings) -> Steps:
    """(step, converted heads) in the plan's layer order, for methods that need only the
    layer's weights; an encoder-decoder's steps are its layers' self-, cross- and (when
    grouped) encoder attentions."""
    spec = archmod.registry()[plan.family]
    gen = torch.Generator().manual_seed(settings.seed)
    method_fn = method_function(settings.method)
    group_fn = GROUPINGS[settings.grouping]
    for step in plan.attention_layers():
        layer, shape = step.layer, plan.shape_at(step.site).at(step.layer)
        G = settings.kv_heads_at(layer)
        # float64 keeps fp32 weights exact through the math; 16-bit values are exact in fp32
        wide = any(opened.source.meta(n)[0] in (torch.float32, torch.float64) for n in step.names)
        dtype = torch.float64 if wide else torch.float32
        tensors = {n: opened.source.get(n).to(dtype) for n in step.names}  # widened as read: one at a time
        heads = read_heads(spec, shape, tensors, layer, dtype=dtype, site=step.site)
        del tensors  # memory is one layer's attention: nothing but the method's result outlives its step
        groups = group_fn(heads, G, rotary_style=spec.rotary.style, rotary_dim=shape.rotary_dim)
        ctx = PoolContext(G, groups, spec.rotary.style, shape.rotary_dim, layer, gen)
        new = method_fn(heads, ctx)
        del heads, groups, ctx
        yield step, new
        del new


def per_layer_heads(opened: Opened, plan: Plan, settings: ResolvedSettings) -> Layers:
    """(layer, converted heads) in layer order, for methods that need only the layer's weights
    (`per_step_heads` with each step's layer: for a decoder-only model, one step per layer)."""
    for step, new in per_step_heads(opened, plan, settings):
        yield step.layer, new


def converted_layers(opened: Opened, plan: Plan, settings: ResolvedSettings, *, device: str = "cpu",
                     scratch: Path | None = None, resume_dir: Path | None = None,
                     written: Callable[[], list[str]] | None = None) -> tuple[Steps, Any]:
    """(step, converted heads) in layer order, and the calibration stage that makes them
    (its `summary` is recorded in OUT) or None: a method that needs data runs as the stage,
    one decoder block at a time on `device`; any other converts each layer from its weights."""
    if settings.staged:
        from gqakit.convert.calibration import CalibrationStage

        stage = CalibrationStage(opened, plan, settings, device=device, scratch=scratch,
                                 resume_dir=resume_dir, written=written)
        steps = {step.layer: step for step in plan.attention_layers()}  # decoder-only: one step per layer
        return ((steps[layer], new) for layer, new in stage.layers()), stage
    return per_step_heads(opened, plan, settings), None


# ----------------------------------------------------------------------------- a model folder

def convert_folder(settings: ConvertSettings, out: str | Path, *, overwrite: bool = False,
                   device: str = "auto") -> Path:
    """Convert `settings.source` to the model folder OUT.

    Unchanged tensors are copied first, in file order; then the attention of each layer,
    in layer order, either from that layer's weights alone (mean, align, ...) or from a
    calibration stage that holds one decoder block at a time (align-refit) on `device`.
    Bars and messages as the run context says (`core.run`).
    """
    from gqakit.core.device import resolve_device

    src, out, staged = Path(settings.source), Path(out), settings.staged
    dev, progress = resolve_device(device), show_bars()
    inputs = settings.inputs
    check_output_path(out, overwrite=overwrite, inputs=inputs)
    opened = open_model(src)
    settings, choice = choose_for(opened, settings, device=dev, progress=progress)
    plan = make_plan(opened, settings, device=dev, kv_heads=None if choice is None else choice.kv_heads)
    settings = plan.settings = with_choice(plan.settings, choice)
    if progress:
        for line in auto_lines(settings):
            tqdm.write(line, file=sys.stderr)
    t0 = time.perf_counter()
    if staged:  # long runs keep their work when killed, and resume from it
        folder = resumable_output_dir(out, fingerprint=_fingerprint(opened, plan, settings), overwrite=overwrite,
                                      inputs=inputs)
    else:
        folder = _not_resumable(atomic_output_dir(out, overwrite=overwrite, inputs=inputs))
    with folder as (tmp, resumed):
        state = None
        if resumed:  # (the calibration package is imported by the runs that calibrate)
            from gqakit.convert.calibration import load_state

            state = load_state(tmp / RESUME_DIR)
        if resumed and progress:
            tqdm.write(resume_line(tmp, state, plan.shape.num_layers), file=sys.stderr)
        assert settings.max_shard_bytes is not None  # a model folder
        from_stage = trained_block_tensors(plan, settings)
        planned_dtype = {p.name: p.dtype for p in plan.tensors}
        writer = ShardWriter(tmp, plan.tensors, settings.max_shard_bytes, {"gqakit": gqakit.__version__},
                             written=state["written"] if state else (),
                             origins=copied_from(opened.source, plan, planned_dtype, from_stage))
        done = set(writer.written)
        try:
            bar = tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="converting",
                       disable=not progress or staged)
            # 1. every tensor the method leaves as it is, in file order
            for name in (step.name for step in plan.pass_through()):
                if name in done or name in from_stage:
                    continue
                # the bytes copied as they are, or decoded and written a row block at a time
                bar.update(copy_tensor(opened.source, writer, name, planned_dtype[name]))
            # 2. the attention, layer by layer
            spec = archmod.registry()[plan.family]
            layers, stage = converted_layers(opened, plan, settings, device=dev, scratch=tmp / ".scratch",
                                             resume_dir=tmp / RESUME_DIR, written=lambda: writer.written)
            orders: dict[int, list[int] | None] = {}  # each layer's query head order (`record.output_config`)
            with _one_thread() if stage is None else nullcontext():  # (small K/V math beside the kernel's copies)
                for step, new in layers:
                    layer = step.layer
                    if step.site == "self":
                        orders[layer] = new.q_order
                    out_dtypes = {n: planned_dtype[n] for n in step.names}
                    for n, t in write_heads(spec, new, layer, out_dtypes, site=step.site).items():
                        if n in done:  # already in the shards (a resumed run restarts after its saved state)
                            continue
                        writer.write(n, t)
                        bar.update(t.numel() * t.dtype.itemsize)
                    for n, t in (stage.block_tensors(layer).items() if from_stage else ()):
                        if n not in from_stage:
                            raise GqakitError(f"the calibration stage trained {n}, which the plan copies from "
                                              "the source")
                        if n not in done:
                            writer.write(n, t.to(planned_dtype[n]))
                    new = t = None  # before the next layer is read: memory is one layer's attention
                writer.finish()
            bar.close()
        finally:
            writer.close()
            opened.source.close()
            shutil.rmtree(tmp / ".scratch", ignore_errors=True)
        calibration = stage.summary if stage is not None else None
        if stage is not None:  # a resumed calibration yields only the layers after its saved state
            orders = {**stage.q_orders, **orders}
        write_metadata(tmp, opened, plan, settings, time.perf_counter() - t0, calibration,
                       described=stage.describe() if stage is not None else None, query_orders=orders)
        if calibration and progress:
            tqdm.write(drift_summary(calibration))
    return out.expanduser().resolve()


def resume_line(folder: Path, state: dict[str, Any] | None, layers: int) -> str:
    """The line a resumed conversion prints: layers counted from 1, as in the progress bar
    (`state["layers_done"]`, the resume state's count of finished layers, is also the 0-based
    index of the next one)."""
    if not state:
        return f"resuming the conversion in {folder}"
    done = int(state["layers_done"])
    return f"resuming the conversion in {folder} after layer {done}/{layers} (next: layer {done + 1}/{layers})"


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside. A conversion without calibration computes only each
    layer's K/V heads while the writer's thread copies the rest: with one thread, no idle OpenMP
    worker spins on the core the copies need."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _not_resumable(ctx: Any) -> Iterator[tuple[Path, bool]]:
    with ctx as tmp:
        yield tmp, False


def _fingerprint(opened: Opened, plan: Plan, settings: ResolvedSettings) -> str:
    """What makes two runs the same conversion: settings, source files, plan, gqakit version."""
    files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in opened.source.files() if p.exists()]
    record = settings.record()
    for part in ("options", "auto"):  # where the streams live (and the free memory that chose it) changes no value
        record.get(part, {}).pop("offload", None)
    key = {"settings": record, "files": files, "version": gqakit.__version__,
           "tensors": [(p.name, str(p.dtype), list(p.shape)) for p in plan.tensors]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------- one GGUF file

def convert_gguf_file(settings: ConvertSettings, out: str | Path, *, gguf_type: str | None = None,
                      overwrite: bool = False, device: str = "auto", dry_run: bool = False) -> Path | list[str]:
    """Convert `settings.source` (a .gguf file) to OUT.gguf: every tensor the method leaves as
    it is keeps its exact bytes, the changed ones are written in `gguf_type` (`gguf_out`).

    `dry_run`: check everything, write nothing, and return the plan as lines of text. Bars and
    messages as the run context says (`core.run`)."""
    from gqakit.convert.gguf_in import open_gguf_source
    from gqakit.convert.gguf_out import GGUFWriter, changed_tensors, parse_gguf_type
    from gqakit.core.device import resolve_device

    src, out, staged, G = Path(settings.source), Path(out).expanduser(), settings.staged, settings.num_kv_heads
    if not src.exists():
        raise GqakitError(f"source not found: {src}")
    if not (src.is_file() and src.suffix.lower() == ".gguf"):
        raise GqakitError(f"a .gguf OUT needs a .gguf SRC (got {src}); a model folder converts to a folder, "
                          "or to GGUF with llama.cpp's convert_hf_to_gguf.py")
    r = settings.refit  # (the source's K/V head count is not read yet; "auto" never trains blocks into GGUF)
    if staged and r.train == "block" and (r.train_steps() > 0 or (r.steps == "auto" and settings.effort == "best")):
        raise GqakitError("--refit-option train=block rewrites every block's weights: convert to a model folder, "
                          "not to GGUF (a GGUF OUT keeps the unchanged tensors' quantised bytes)")
    wanted = parse_gguf_type(gguf_type)
    dev, progress = resolve_device(device), show_bars()
    inputs = settings.inputs
    check_output_path(out, overwrite=overwrite, inputs=inputs, kind=GGUF_FILE)
    inp = open_gguf_source(src)
    opened, reader = inp.opened, inp.reader
    plan = make_plan(opened, settings, gguf_out=True, device=dev)
    settings = plan.settings
    G = settings.num_kv_heads  # the largest layer's, for a per-layer plan
    changed = changed_tensors(inp, plan, G, wanted)
    if dry_run:
        s = plan.shape
        kinds = sorted({f"{c.qtype.name}" for c in changed.values()})
        return [f"{plan.family} (GGUF {inp.arch}): {s.num_layers} layers, {s.num_heads} query heads, "
                f"{s.num_kv_heads} -> {list(settings.kv_heads) if settings.kv_heads else G} KV heads, "
                f"head_dim {s.head_dim}", *auto_lines(settings),
                *expected_time_lines(opened, plan, dev),
                f"{len(reader.tensors)} tensors: {len(reader.tensors) - len(changed)} copied as they are, "
                f"{len(changed)} re-encoded as {', '.join(kinds)}; method {settings.method}; nothing written (dry run)"]

    t0 = time.perf_counter()
    if progress:
        for line in auto_lines(settings):
            tqdm.write(line, file=sys.stderr)
        tqdm.write(f"{src.name} (GGUF {inp.arch}, memory-mapped): {len(reader.tensors) - len(changed)} tensors "
                   f"copied as they are, {len(changed)} converted", file=sys.stderr)
    with atomic_output_file(out, overwrite=overwrite, inputs=inputs, kind=GGUF_FILE) as (tmp, scratch):
        writer = GGUFWriter(tmp, reader, inp.arch, G, plan, settings, changed, staged)
        layers, stage = converted_layers(opened, plan, settings, device=dev, scratch=scratch,
                                         resume_dir=None, written=lambda: [])
        try:
            writer.write((step.layer, new) for step, new in layers)
            calibration = stage.summary if stage is not None else None
            writer.finish(calibration, time.perf_counter() - t0)
        finally:
            writer.close()
        if calibration and progress:
            tqdm.write(drift_summary(calibration))
    return out.resolve()
