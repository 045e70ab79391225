"""`convert_checkpoint`: plan, then stream a checkpoint through the pooling math to OUT.

    source folder/.gguf --> config + architecture entry --> plan (names, dtypes, shapes)
      --> for each tensor in file order: pass through, or (attention of layer L) read the
          layer's q/k/v/o, run the method, write the new tensors
      --> config.json, tokenizer, model card, gqakit_convert.json --> atomic rename to OUT
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import gqakit
from gqakit.core import arch as archmod
from gqakit.convert.io import Planned, ShardWriter, Source, DictSource, open_source
from gqakit.convert.layout import AttnHeads, layer_names, output_shapes, read_heads, write_heads
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.methods import DEFAULT_METHOD, method_spec
from gqakit.convert.pooling import PoolContext
from gqakit.core.errors import GqakitError
from gqakit.core.loading import CONVERT_SETTINGS, REMOTE_PREFIX, read_config_json
from gqakit.core.modelcard import render_model_card
from gqakit.core.outdir import RESUME_DIR, atomic_output_dir, check_output_path, resumable_output_dir

# Calibration memory no longer grows with the token count times the depth (one block and two
# hidden-state streams at a time), so the default budget is set by time, not memory:
# docs/benchmarks.md shows align-refit keeps improving well past 16k tokens.
DEFAULT_CALIBRATION_TOKENS = 65536
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# files copied verbatim from SRC: tokenizer and generation settings
COPY_PATTERNS = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|"
    r".*\.tiktoken|spiece\.model|sentencepiece.*\.model|chat_template\.(jinja|json)|generation_config\.json)$"
)


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
    if not m:
        raise GqakitError(f"invalid size {text!r}; use e.g. 2GB or 500MB")
    return int(float(m.group(1)) * 1000 ** " KMGT".index(m.group(2) or " "))


@dataclass
class Settings:
    """Everything that determines a conversion; written to OUT/gqakit_convert.json."""

    source: str
    num_kv_heads: int
    method: str = DEFAULT_METHOD
    grouping: str = "contiguous"
    dtype: str = "auto"
    max_shard_size: str = "2GB"
    seed: int = 0
    calibration_data: str | None = None
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PassThrough:
    """A source tensor the method leaves as it is (cast to the output dtype, if any)."""

    name: str


@dataclass(frozen=True)
class AttentionLayer:
    """One layer's attention tensors, rewritten together by the method."""

    layer: int
    names: tuple[str, ...]  # in the table's role order; only those the method rewrites


Step = PassThrough | AttentionLayer


@dataclass
class Plan:
    family: str
    native_gqa: bool
    shape: archmod.Shape
    config: dict[str, Any]
    steps: list[Step]        # the source in file order; each layer's attention once, where it first appears
    tensors: list[Planned]   # the output tensors, step by step
    source_params: int
    output_params: int

    @cached_property
    def layer_of(self) -> dict[str, int]:
        """Attention tensor name -> layer, for the tensors the method rewrites."""
        return {n: s.layer for s in self.attention_layers() for n in s.names}

    def pass_through(self) -> list[PassThrough]:
        return [s for s in self.steps if isinstance(s, PassThrough)]

    def attention_layers(self) -> list[AttentionLayer]:
        """In layer order (the order methods and the calibration stage yield them)."""
        return sorted((s for s in self.steps if isinstance(s, AttentionLayer)), key=lambda s: s.layer)


# ----------------------------------------------------------------------------- source

@dataclass
class Opened:
    folder: Path          # where config/tokenizer files come from
    gguf: str | None
    config: dict[str, Any]
    source: Source


def open_checkpoint(src: str | Path, *, progress: bool = True) -> Opened:
    src = Path(src).expanduser()
    if not src.exists():
        raise GqakitError(f"source not found: {src}")
    if src.is_file() and src.suffix == ".gguf":
        return _open_gguf(src, progress=progress)
    if not src.is_dir():
        raise GqakitError(f"source {src} is neither a model folder nor a .gguf file")
    if not any(src.iterdir()):
        raise GqakitError(f"source folder {src} is empty")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise GqakitError(f"no config.json in {src}; is it a Hugging Face model folder?")
    config = read_config_json(src)
    return Opened(src, None, config, open_source(src))


def _open_gguf(path: Path, *, progress: bool = True) -> Opened:
    """GGUF input: transformers dequantizes it to float; the tensors then stream as usual."""
    from gqakit.core.loading import load_causal_lm

    from gqakit.core.quiet import quiet_libraries

    if progress:
        tqdm.write(f"reading {path.name} (GGUF, dequantized by transformers)", file=sys.stderr)
    with quiet_libraries(not progress):
        model = load_causal_lm(path)
    config = model.config.to_dict()
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    config.pop("_model_name_or_path", None)
    # the weights are dequantized floats now: a GGUF quantization_config would make
    # transformers treat the output as quantized (and refuse to save it after training)
    config.pop("quantization_config", None)
    config["dtype"] = str(next(iter(model.state_dict().values())).dtype).replace("torch.", "")
    sd = model.state_dict()
    if config.get("tie_word_embeddings") and "lm_head.weight" in sd:
        del sd["lm_head.weight"]  # tied: stored once, as the embedding
    return Opened(path.parent, path.name, config, DictSource(dict(sd), [path]))


# ----------------------------------------------------------------------------- planning

def validate_g(shape: archmod.Shape, g: int) -> None:
    kv = shape.num_kv_heads
    if g <= 0:
        raise GqakitError(f"--num-kv-heads must be at least 1, got {g}")
    if g > kv:
        raise GqakitError(f"--num-kv-heads {g} is larger than the model's {kv} KV heads")
    if kv % g:
        valid = [d for d in range(1, kv + 1) if kv % d == 0]
        raise GqakitError(f"--num-kv-heads {g} does not divide the model's {kv} KV heads; valid: {valid}")


def make_plan(opened: Opened, settings: Settings) -> Plan:
    spec = archmod.lookup(opened.config)
    shape = archmod.shape_of(spec, opened.config)
    validate_g(shape, settings.num_kv_heads)
    out_dtype = DTYPES.get(settings.dtype)
    if settings.dtype != "auto" and out_dtype is None:
        raise GqakitError(f"unknown dtype {settings.dtype!r}; choose auto, {', '.join(DTYPES)}")
    src = opened.source
    names = src.names()
    metas = {n: src.meta(n) for n in names}
    # methods that touch only K/V leave q and o to be copied through untouched
    kv_only = (method_spec(settings.method).kv_only and settings.grouping == "contiguous"
               and spec.attention.layout == "separate")
    layer_of: dict[str, int] = {}
    for layer in range(shape.num_layers):
        roles = layer_names(spec, layer)
        for role, name in roles.items():
            if name in metas and (not kv_only or role[0] in "kv"):
                layer_of[name] = layer
            elif name not in metas and role.endswith("weight"):
                where = ", ".join(p.name for p in src.files()) or "the source"
                raise GqakitError(f"tensor {name} required by the {spec.family} layout but not present in {where}")
    steps = list(_walk(spec, names, layer_of))
    tensors: list[Planned] = []
    for step in steps:
        if isinstance(step, PassThrough):
            dt = metas[step.name][0]
            cast = out_dtype if (out_dtype is not None and dt.is_floating_point) else dt
            tensors.append(Planned(step.name, cast, metas[step.name][1]))
            continue
        shapes = output_shapes(spec, shape, settings.num_kv_heads, step.layer, {n: metas[n][1] for n in step.names})
        tensors += [Planned(n, out_dtype if out_dtype is not None else metas[n][0], shapes[n]) for n in step.names]
    numel = lambda s: int(torch.Size(s).numel())  # noqa: E731
    return Plan(spec.family, spec.native_gqa, shape, opened.config, steps, tensors,
                sum(numel(m[1]) for m in metas.values()), sum(numel(p.shape) for p in tensors))


def _walk(spec: archmod.ArchSpec, names: list[str], layer_of: dict[str, int]) -> Iterator[Step]:
    """The source tensors in file order, each layer's attention as one step where its first tensor is."""
    seen: set[int] = set()
    for name in names:
        if name not in layer_of:
            yield PassThrough(name)
        elif layer_of[name] not in seen:
            layer = layer_of[name]
            seen.add(layer)
            yield AttentionLayer(layer, tuple(n for n in layer_names(spec, layer).values() if n in layer_of))


# ----------------------------------------------------------------------------- converting

def _output_config(plan: Plan, settings: Settings) -> dict[str, Any]:
    cfg = dict(plan.config)
    spec = archmod.registry()[plan.family]
    if plan.native_gqa:
        cfg[spec.config.num_kv_heads or "num_key_value_heads"] = settings.num_kv_heads
    else:
        from gqakit.convert.remote import remote_config_updates

        cfg.update(remote_config_updates(plan.family, settings.num_kv_heads))
    if settings.dtype != "auto":
        cfg["dtype"] = settings.dtype
        cfg.pop("torch_dtype", None)
    if plan.native_gqa:
        cfg.pop("auto_map", None)  # stock class: any source remote code does not apply
    cfg.pop("_name_or_path", None)
    return cfg


def _copy_side_files(opened: Opened, tmp: Path) -> list[str]:
    copied = []
    if opened.gguf:  # the tokenizer lives inside the GGUF file
        from gqakit.core.loading import load_tokenizer

        load_tokenizer(opened.folder / opened.gguf).save_pretrained(tmp)
        return sorted(p.name for p in tmp.iterdir())
    for p in sorted(opened.folder.iterdir()):
        if p.is_file() and COPY_PATTERNS.match(p.name):
            shutil.copy2(p, tmp / p.name)
            copied.append(p.name)
    return copied


def _per_layer_heads(opened: Opened, plan: Plan, settings: Settings) -> Iterator[tuple[int, AttnHeads]]:
    """(layer, converted heads) in layer order, for methods that need only the layer's weights."""
    spec = archmod.registry()[plan.family]
    gen = torch.Generator().manual_seed(settings.seed)
    method_fn = method_spec(settings.method).fn
    group_fn = GROUPINGS[settings.grouping]
    for step in plan.attention_layers():
        layer = step.layer
        tensors = {n: opened.source.get(n) for n in step.names}
        # float64 keeps fp32 checkpoints exact through the math; 16-bit values are exact in fp32
        wide = any(t.dtype in (torch.float32, torch.float64) for t in tensors.values())
        heads = read_heads(spec, plan.shape, tensors, layer, dtype=torch.float64 if wide else torch.float32)
        groups = group_fn(heads, settings.num_kv_heads, rotary_style=spec.rotary.style,
                          rotary_dim=plan.shape.rotary_dim)
        ctx = PoolContext(settings.num_kv_heads, groups, spec.rotary.style, plan.shape.rotary_dim, layer, gen)
        yield layer, method_fn(heads, ctx)


def check_settings(settings: Settings) -> bool:
    """Every setting checked before anything is read or written (one-line errors); True when
    the method calibrates on data, so that the pipeline runs the calibration stage."""
    staged = method_spec(settings.method).needs_data
    if settings.grouping not in GROUPINGS:
        raise GqakitError(f"unknown grouping {settings.grouping!r}; choose from {', '.join(GROUPINGS)}")
    data = settings.calibration_data
    if staged:
        from gqakit.convert.calibrate import refit_options

        refit_options(settings.options)
        if settings.calibration_tokens < 1:
            raise GqakitError(f"--calibration-tokens must be at least 1, got {settings.calibration_tokens}")
        if data and not str(data).startswith("hf:") and not Path(data).expanduser().is_file():
            raise GqakitError(f"calibration data not found: {Path(data).expanduser()}")
    elif settings.options:
        raise GqakitError(f"method {settings.method} takes no options (got {', '.join(settings.options)})")
    return staged


def trained_block_tensors(plan: Plan, settings: Settings) -> set[str]:
    """The pass-through tensors the calibration stage rewrites (`--refit-option train=block`
    with reconstruction steps: each converted block's MLP and norms), which the writer
    takes from the stage rather than from the source."""
    from gqakit.convert.calibrate import refit_options, trains_block

    if not method_spec(settings.method).needs_data or not trains_block(
            refit_options(settings.options), plan.shape.num_kv_heads, settings.num_kv_heads):
        return set()
    spec = archmod.registry()[plan.family]
    prefixes = tuple(spec.block_name(L) + "." for L in range(plan.shape.num_layers))
    return {s.name for s in plan.pass_through() if s.name.startswith(prefixes)}


def converted_layers(opened: Opened, plan: Plan, settings: Settings, *, device: str = "cpu", progress: bool = True,
                     scratch: Path | None = None, resume_dir: Path | None = None,
                     written: Callable[[], list[str]] | None = None) -> tuple[Iterator[tuple[int, AttnHeads]], Any]:
    """(layer, converted heads) in layer order, and the calibration stage that makes them
    (its `summary` is recorded in OUT) or None: a method that needs data runs as the stage,
    one decoder block at a time on `device`; any other converts each layer from its weights."""
    if method_spec(settings.method).needs_data:
        from gqakit.convert.calibrate import RefitStage

        stage = RefitStage(opened, plan, settings, device=device, progress=progress, scratch=scratch,
                           resume_dir=resume_dir, written=written)
        return stage.layers(), stage
    return _per_layer_heads(opened, plan, settings), None


def convert_checkpoint(src: str | Path, out: str | Path, num_kv_heads: int, method: str = DEFAULT_METHOD, *,
                       grouping: str = "contiguous", dtype: str = "auto", overwrite: bool = False,
                       max_shard_size: str = "2GB", seed: int = 0, calibration_data: str | None = None,
                       calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS, options: dict[str, Any] | None = None,
                       device: str = "auto", progress: bool = True) -> Path:
    """Convert SRC (HF folder or .gguf) to OUT with `num_kv_heads` K/V heads per layer.

    Unchanged tensors are copied first, in file order; then the attention of each layer,
    in layer order, either from that layer's weights alone (mean, align, ...) or from a
    calibration stage that holds one decoder block at a time (align-refit) on `device`.
    """
    from gqakit.core.device import resolve_device

    settings = Settings(str(Path(src).expanduser().resolve()), num_kv_heads, method, grouping, dtype,
                        str(max_shard_size), seed, calibration_data, calibration_tokens, options or {})
    staged = check_settings(settings)
    dev = resolve_device(device)
    max_bytes = parse_size(max_shard_size)
    calib_file = calibration_data if calibration_data and not str(calibration_data).startswith("hf:") else None
    inputs = [("source", Path(src)), ("calibration data", calib_file)]
    check_output_path(Path(out), overwrite=overwrite, inputs=inputs)
    opened = open_checkpoint(src, progress=progress)
    plan = make_plan(opened, settings)
    t0 = time.perf_counter()
    if staged:  # long runs keep their work when killed, and resume from it
        folder = resumable_output_dir(Path(out), fingerprint=_fingerprint(opened, plan, settings),
                                      overwrite=overwrite, inputs=inputs)
    else:
        folder = _not_resumable(atomic_output_dir(Path(out), overwrite=overwrite, inputs=inputs))
    with folder as (tmp, resumed):
        from gqakit.convert.calibrate import load_checkpoint

        state = load_checkpoint(tmp / RESUME_DIR) if resumed else None
        if resumed and progress:
            tqdm.write(f"resuming the conversion in {tmp}" + (f" after layer {state['layers_done'] - 1}" if state else ""))
        writer = ShardWriter(tmp, plan.tensors, max_bytes, {"gqakit": gqakit.__version__},
                             written=state["written"] if state else ())
        done = set(writer.written)
        from_stage = trained_block_tensors(plan, settings)
        try:
            planned_dtype = {p.name: p.dtype for p in plan.tensors}
            bar = tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="converting",
                       disable=not progress or staged)
            # 1. every tensor the method leaves as it is, in file order
            for name in (step.name for step in plan.pass_through()):
                if name in done or name in from_stage:
                    continue
                raw = opened.source.raw(name)
                if raw is not None and opened.source.meta(name)[0] == planned_dtype[name]:
                    writer.write_raw(name, *raw)  # unchanged: copy the bytes, decode nothing
                    bar.update(raw[2])
                else:
                    t = opened.source.get(name).to(planned_dtype[name])
                    writer.write(name, t)
                    bar.update(t.numel() * t.dtype.itemsize)
            # 2. the attention, layer by layer
            spec = archmod.registry()[plan.family]
            layers, stage = converted_layers(opened, plan, settings, device=dev, progress=progress,
                                             scratch=tmp / ".scratch", resume_dir=tmp / RESUME_DIR,
                                             written=lambda: writer.written)
            steps = {step.layer: step for step in plan.attention_layers()}
            for layer, new in layers:
                out_dtypes = {n: planned_dtype[n] for n in steps[layer].names}
                for n, t in write_heads(spec, new, layer, out_dtypes).items():
                    if n in done:  # already in the shards (a resumed run restarts after its checkpoint)
                        continue
                    writer.write(n, t)
                    bar.update(t.numel() * t.dtype.itemsize)
                for n, t in (stage.block_tensors(layer).items() if from_stage else ()):
                    if n not in from_stage:
                        raise GqakitError(f"the calibration stage trained {n}, which the plan copies from the source")
                    if n not in done:
                        writer.write(n, t.to(planned_dtype[n]))
            writer.finish()
            bar.close()
        finally:
            writer.close()
            opened.source.close()
            shutil.rmtree(tmp / ".scratch", ignore_errors=True)
        calibration = stage.summary if stage is not None else None
        _write_metadata(tmp, opened, plan, settings, time.perf_counter() - t0, calibration)
        if calibration and progress:
            tqdm.write(drift_summary(calibration))
    return Path(out).expanduser().resolve()


@contextmanager
def _not_resumable(ctx: Any) -> Iterator[tuple[Path, bool]]:
    with ctx as tmp:
        yield tmp, False


def _fingerprint(opened: Opened, plan: Plan, settings: Settings) -> str:
    """What makes two runs the same conversion: settings, source files, plan, gqakit version."""
    files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in opened.source.files() if p.exists()]
    key = {"settings": asdict(settings), "files": files, "version": gqakit.__version__,
           "tensors": [(p.name, str(p.dtype), list(p.shape)) for p in plan.tensors]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def drift_summary(cal: dict[str, Any]) -> str:
    """One line on how far the converted model's residual stream drifted from the original's."""
    d = cal.get("residual_drift") or []
    if not d:
        return f"calibrated on {cal['tokens']:,} tokens"
    worst = max(range(len(d)), key=d.__getitem__)
    return (f"calibrated on {cal['tokens']:,} tokens; residual drift after the last layer {d[-1]:.3f} "
            f"(mean {sum(d) / len(d):.3f}, worst {d[worst]:.3f} after layer {worst}; 0 = identical to the original)")


def _write_metadata(tmp: Path, opened: Opened, plan: Plan, settings: Settings, seconds: float,
                    calibration: dict[str, Any] | None = None) -> None:
    cfg = _output_config(plan, settings)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    copied = _copy_side_files(opened, tmp)
    if not plan.native_gqa:
        from gqakit.convert.remote import modeling_file

        f = modeling_file(plan.family)
        assert f.name.startswith(REMOTE_PREFIX)
        shutil.copy2(f, tmp / f.name)
    s, G = plan.shape, settings.num_kv_heads
    elem = _attention_itemsize(plan)
    before, after = s.kv_bytes_per_token(elem), s.kv_bytes_per_token(elem, G)
    record = {"gqakit_version": gqakit.__version__, "settings": asdict(settings), "family": plan.family,
              "num_heads": s.num_heads, "num_kv_heads_before": s.num_kv_heads, "num_kv_heads": G,
              "head_dim": s.head_dim, "num_layers": s.num_layers,
              "parameters_before": plan.source_params, "parameters_after": plan.output_params,
              "kv_cache_bytes_per_token_before": before, "kv_cache_bytes_per_token_after": after,
              "seconds": round(seconds, 3), "copied_files": copied,
              "loads_with": "AutoModelForCausalLM.from_pretrained(OUT)" if plan.native_gqa
              else "AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)"}
    if calibration:
        record["calibration"] = calibration
    (tmp / CONVERT_SETTINGS).write_text(json.dumps(record, indent=2) + "\n")
    facts = {"source": f"`{settings.source}`", "family": plan.family, "method": settings.method,
             "grouping": settings.grouping, "query heads": s.num_heads,
             "KV heads": f"{s.num_kv_heads} → {G}", "KV cache per token": f"{before:,} → {after:,} bytes "
             f"({s.num_kv_heads // G}× smaller)", "parameters": f"{plan.source_params:,} → {plan.output_params:,}",
             "load with": f"`{record['loads_with']}`", "gqakit": gqakit.__version__}
    if calibration:
        facts["calibration"] = f"{calibration['calibration']} on {calibration['device']}"
        from gqakit.convert.calibrate import QUALITY_SIGNAL, describe

        facts["method"] = f"{settings.method}: {describe(calibration)}"
        facts["residual drift"] = drift_summary(calibration).split("; ", 1)[-1]
        facts["expected quality"] = QUALITY_SIGNAL
    else:
        doc = (getattr(method_spec(settings.method).fn, "__doc__", None) or "").strip().split("\n\n")[0]
        if doc:
            facts["method"] = f"{settings.method}: {' '.join(doc.split())}"
    summary = ("Grouped-query-attention conversion made with gqakit. Each group of K/V heads was pooled into "
               "one head; quality usually drops until the model is uptrained (`gqakit uptrain`).")
    (tmp / "README.md").write_text(render_model_card(
        title=f"{Path(settings.source).name} → GQA ({G} KV heads)", base_model=settings.source,
        summary=summary, facts=facts, settings=asdict(settings)))


def _attention_itemsize(plan: Plan) -> int:
    """Bytes per element of the output K/V projections: the KV cache's natural dtype."""
    for p in plan.tensors:
        if p.name in plan.layer_of:
            return p.dtype.itemsize
    return 4
