"""`convert_checkpoint`: plan, then stream a checkpoint through the pooling math to OUT.

    source folder/.gguf --> config + architecture entry --> plan (names, dtypes, shapes)
      --> for each tensor in file order: pass through, or (attention of layer L) read the
          layer's q/k/v/o, run the method, write the new tensors
      --> config.json, tokenizer, model card, gqakit_convert.json --> atomic rename to OUT
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import gqakit
from gqakit.convert import arch as archmod
from gqakit.convert.io import Planned, ShardWriter, Source, DictSource, open_source
from gqakit.convert.layout import layer_names, output_shapes, read_heads, write_heads
from gqakit.convert.pooling import METHODS, PoolContext, contiguous_groups
from gqakit.core.errors import GqakitError
from gqakit.core.loading import CONVERT_SETTINGS, REMOTE_PREFIX, read_config_json
from gqakit.core.modelcard import render_model_card
from gqakit.core.outdir import atomic_output_dir, check_output_path

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
    method: str = "mean"
    grouping: str = "contiguous"
    dtype: str = "auto"
    max_shard_size: str = "2GB"
    seed: int = 0
    calibration_data: str | None = None
    calibration_tokens: int = 16384
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    family: str
    native_gqa: bool
    shape: archmod.Shape
    config: dict[str, Any]
    tensors: list[Planned]
    layer_of: dict[str, int]  # attention tensor name -> layer
    source_params: int
    output_params: int

    def kv_bytes_per_token(self, kv_heads: int, bytes_per_elem: int) -> int:
        return 2 * self.shape.num_layers * kv_heads * self.shape.head_dim * bytes_per_elem


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
    from gqakit.convert.methods import all_methods

    # methods that touch only K/V leave q and o to be copied through untouched
    kv_only = (getattr(all_methods().get(settings.method), "kv_only", False) and settings.grouping == "contiguous"
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
    tensors: list[Planned] = []
    done: set[int] = set()
    for name in names:
        dt = metas[name][0]
        cast = out_dtype if (out_dtype is not None and dt.is_floating_point) else dt
        if name not in layer_of:
            tensors.append(Planned(name, cast, metas[name][1]))
            continue
        layer = layer_of[name]
        if layer in done:
            continue
        done.add(layer)
        shapes = output_shapes(spec, shape, settings.num_kv_heads, layer, {n: metas[n][1] for n in layer_of})
        for n in layer_names(spec, layer).values():
            if n in shapes and n in layer_of:
                c = out_dtype if out_dtype is not None else metas[n][0]
                tensors.append(Planned(n, c, shapes[n]))
    numel = lambda s: int(torch.Size(s).numel())  # noqa: E731
    return Plan(spec.family, spec.native_gqa, shape, opened.config, tensors, layer_of,
                sum(numel(m[1]) for m in metas.values()), sum(numel(p.shape) for p in tensors))


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


def _prepare_extras(opened: Opened, plan: Plan, settings: Settings) -> dict[str, Any]:
    """Whole-model steps some methods need before the per-layer pass (e.g. calibration)."""
    from gqakit.convert import methods  # registers methods beyond the paper's

    prep = methods.PREPARE.get(settings.method) or methods.PREPARE.get(settings.grouping)
    return prep(opened, plan, settings) if prep else {}


def convert_checkpoint(src: str | Path, out: str | Path, num_kv_heads: int, method: str = "mean", *,
                       grouping: str = "contiguous", dtype: str = "auto", overwrite: bool = False,
                       max_shard_size: str = "2GB", seed: int = 0, calibration_data: str | None = None,
                       calibration_tokens: int = 16384, options: dict[str, Any] | None = None,
                       progress: bool = True) -> Path:
    """Convert SRC (HF folder or .gguf) to OUT with `num_kv_heads` K/V heads per layer."""
    from gqakit.convert import methods

    settings = Settings(str(Path(src).expanduser().resolve()), num_kv_heads, method, grouping, dtype,
                        str(max_shard_size), seed, calibration_data, calibration_tokens, options or {})
    if method not in methods.all_methods():
        raise GqakitError(f"unknown method {method!r}; choose from {', '.join(methods.all_methods())}")
    if grouping not in methods.GROUPINGS:
        raise GqakitError(f"unknown grouping {grouping!r}; choose from {', '.join(methods.GROUPINGS)}")
    max_bytes = parse_size(max_shard_size)
    inputs = [("source", Path(src)), ("calibration data", calibration_data)]
    check_output_path(Path(out), overwrite=overwrite, inputs=inputs)
    opened = open_checkpoint(src, progress=progress)
    plan = make_plan(opened, settings)
    t0 = time.perf_counter()
    extras = _prepare_extras(opened, plan, settings)
    spec = archmod.registry()[plan.family]
    gen = torch.Generator().manual_seed(seed)
    method_fn = methods.all_methods()[method]
    group_fn = methods.GROUPINGS[grouping]
    with atomic_output_dir(Path(out), overwrite=overwrite, inputs=inputs) as tmp:
        writer = ShardWriter(tmp, plan.tensors, max_bytes, {"gqakit": gqakit.__version__})
        src_names = opened.source.names()
        planned_dtype = {p.name: p.dtype for p in plan.tensors}
        names_of_layer: dict[int, list[str]] = {}
        for n, lay in plan.layer_of.items():
            names_of_layer.setdefault(lay, []).append(n)
        bar = tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="converting", disable=not progress)
        done: set[int] = set()
        for name in src_names:
            if name not in plan.layer_of:
                raw = opened.source.raw(name)
                if raw is not None and opened.source.meta(name)[0] == planned_dtype[name]:
                    writer.write_raw(name, *raw)  # unchanged: copy the bytes, decode nothing
                    bar.update(raw[2])
                else:
                    t = opened.source.get(name).to(planned_dtype[name])
                    writer.write(name, t)
                    bar.update(t.numel() * t.dtype.itemsize)
                continue
            layer = plan.layer_of[name]
            if layer in done:
                continue
            done.add(layer)
            tensors = {n: opened.source.get(n) for n in names_of_layer[layer]}
            # float64 keeps fp32 checkpoints exact through the math; 16-bit values are exact in fp32
            wide = any(t.dtype in (torch.float32, torch.float64) for t in tensors.values())
            heads = read_heads(spec, plan.shape, tensors, layer, dtype=torch.float64 if wide else torch.float32)
            ctx = PoolContext(num_kv_heads, contiguous_groups(plan.shape.num_kv_heads, num_kv_heads),
                              spec.rotary.style, plan.shape.rotary_dim, layer, gen, extras)
            ctx.groups = group_fn(heads, ctx)
            new = method_fn(heads, ctx)
            out_dtypes = {p.name: p.dtype for p in plan.tensors if p.name in tensors}
            for n, t in write_heads(spec, new, layer, out_dtypes).items():
                writer.write(n, t)
                bar.update(t.numel() * t.dtype.itemsize)
        writer.finish()
        bar.close()
        opened.source.close()
        _write_metadata(tmp, opened, plan, settings, time.perf_counter() - t0)
    return Path(out).expanduser().resolve()


def _write_metadata(tmp: Path, opened: Opened, plan: Plan, settings: Settings, seconds: float) -> None:
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
    before, after = plan.kv_bytes_per_token(s.num_kv_heads, elem), plan.kv_bytes_per_token(G, elem)
    record = {"gqakit_version": gqakit.__version__, "settings": asdict(settings), "family": plan.family,
              "num_heads": s.num_heads, "num_kv_heads_before": s.num_kv_heads, "num_kv_heads": G,
              "head_dim": s.head_dim, "num_layers": s.num_layers,
              "parameters_before": plan.source_params, "parameters_after": plan.output_params,
              "kv_cache_bytes_per_token_before": before, "kv_cache_bytes_per_token_after": after,
              "seconds": round(seconds, 3), "copied_files": copied,
              "loads_with": "AutoModelForCausalLM.from_pretrained(OUT)" if plan.native_gqa
              else "AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)"}
    (tmp / CONVERT_SETTINGS).write_text(json.dumps(record, indent=2) + "\n")
    facts = {"source": f"`{settings.source}`", "family": plan.family, "method": settings.method,
             "grouping": settings.grouping, "query heads": s.num_heads,
             "KV heads": f"{s.num_kv_heads} → {G}", "KV cache per token": f"{before:,} → {after:,} bytes "
             f"({s.num_kv_heads // G}× smaller)", "parameters": f"{plan.source_params:,} → {plan.output_params:,}",
             "load with": f"`{record['loads_with']}`", "gqakit": gqakit.__version__}
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
