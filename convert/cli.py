"""`gqakit convert` and `gqakit inspect`."""

from __future__ import annotations

import atexit
import gc
import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import click

from gqakit.convert.geometry_check import check_geometry
from gqakit.convert.refit_options import RefitOptions, refit_options_help
from gqakit.convert.settings import ConvertSettings, check_encoder_decoder
from gqakit.core import arch as archmod
from gqakit.core import trust
from gqakit.core.clihelp import GroupedCommand
from gqakit.core.errors import GqakitError
from gqakit.core.files import format_bytes
from gqakit.core.hub import resolve_model_ref
from gqakit.core.outrule import check_output_path
from gqakit.core.units import DTYPE_BYTES, config_dtype, dtype_label, kv_bytes_text

# `gqakit convert --help`: its options under these headings, in this order
CONVERT_OPTION_GROUPS = (
    ("Input and output", ("dtype", "max_shard_size", "overwrite", "force", "dry_run")),
    ("Method", ("num_kv_heads", "kv_budget", "kv_plan", "method", "grouping", "seed", "group_encoder")),
    ("Calibration (align-refit)", ("effort", "calibration_data", "calibration_tokens", "refit_options")),
    ("GGUF (SRC and OUT both .gguf)", ("gguf_type",)),
    ("Device and run", ("device", "quiet", "trust_remote_code", "help")),
)

# `gqakit inspect` of an encoder-decoder: the default lengths its cache sizes are priced at
SEQ2SEQ_INPUT_LEN, SEQ2SEQ_OUTPUT_LEN = 512, 128


def _settings_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The conversion's click options, generated from `ConvertSettings`' fields (flag, type,
    default and help come from the model; mergekit's `add_merge_options` is the model)."""
    fields = [(name, f) for name, f in ConvertSettings.model_fields.items()
              if isinstance(f.json_schema_extra, dict) and "cli" in f.json_schema_extra]
    for name, f in reversed(fields):
        cli = dict(f.json_schema_extra["cli"])  # type: ignore[index]
        decls, choices = cli.pop("decls"), cli.pop("choices", None)
        kw: dict[str, Any] = {"help": f.description, **cli}
        if choices:
            kw["type"] = click.Choice(list(choices))
        if not cli.get("required"):
            kw["default"] = f.default
        fn = click.option(*decls, name, **kw)(fn)
    return fn


@click.command("convert", cls=GroupedCommand, option_groups=CONVERT_OPTION_GROUPS,
               context_settings={"help_option_names": ["-h", "--help"]}, epilog=refit_options_help())
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@_settings_options
@click.option("--device", default="auto", show_default=True,
              help="Where align-refit calibrates, one decoder block at a time: auto (the first GPU when "
                   "present), cpu, cuda or cuda:N.")
@click.option("--refit-option", "refit_options", multiple=True, metavar="KEY=VALUE",
              help="An align-refit setting, repeatable (the keys and their defaults are listed below).")
@click.option("--gguf-type", default=None, metavar="TYPE",
              help="The GGUF type of the tensors the conversion changes (e.g. F16, Q8_0, Q4_1); every other "
                   "tensor keeps its bytes [default: each tensor's source type when the gguf package can write "
                   "it, else F16].")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--dry-run", is_flag=True, help="Check everything and print the plan; write nothing.")
@click.option("-q", "--quiet", is_flag=True, help="Nothing on stderr but errors (no bars or library warnings), no 'wrote' line (--dry-run still prints its plan).")
@trust.option(" (only align-refit loads SRC with transformers; other methods never run its code)")
@click.pass_context
def convert_cmd(ctx: click.Context, src: Path, out: Path, device: str, refit_options: tuple[str, ...],
                gguf_type: str | None, overwrite: bool, dry_run: bool, quiet: bool, **fields: Any) -> None:
    """Convert the model SRC to grouped-query attention, written to OUT.

    \b
    Examples:
      gqakit convert ./llama-mha ./llama-g4 --num-kv-heads 4
      gqakit convert HuggingFaceTB/SmolLM2-135M ./smollm2-g1 -g 1
      gqakit convert ./llama-mha ./llama-g1 -g 1 --method align-refit --calibration-data calib.txt
      gqakit convert ./llama-mha ./llama-g2 -g 2 --method align-refit --grouping contiguous \\
          --refit-option steps=2000 --refit-option lr=0.01 --refit-option train=block
      gqakit convert ./llama-2-7b ./llama-2-7b-g8 -g 8 --method align-refit --device cuda \\
          --calibration-data hf:wikitext:wikitext-2-raw-v1:train --calibration-tokens 131072
      gqakit convert ./pythia-160m ./pythia-g2 -g 2 --dtype bfloat16
      gqakit convert model.Q4_1.gguf model-g1.Q4_1.gguf -g 1 --method align
      gqakit convert model.gguf model-g1.gguf -g 1 --gguf-type Q8_0
      gqakit convert ./flan-t5-base ./flan-t5-g4 -g 4 --method mean
      gqakit convert ./llama-mha ./llama-half --kv-budget 0.5 --calibration-data calib.txt

    SRC is a Hugging Face model folder (safetensors or pytorch_model*.bin), a .gguf file,
    or a Hub id org/name[@revision] in the Hugging Face cache (a local path of the same
    name wins); it is never modified. OUT is a model folder that loads with stock transformers
    or, when SRC and OUT both end in .gguf, one GGUF file for llama.cpp. OUT appears only
    when complete; a killed align-refit run resumes when the same command runs again.
    """
    skip_exit_collections()
    shard_size_given = ctx.get_parameter_source("max_shard_size") is not click.core.ParameterSource.DEFAULT
    result = run_convert(src, out, device=device, refit=refit_options, gguf_type=gguf_type, overwrite=overwrite,
                         dry_run=dry_run, quiet=quiet, shard_size_given=shard_size_given, **fields)
    for line in (result if isinstance(result, list) else [] if quiet else [f"wrote {result}"]):
        click.echo(line)  # --dry-run's plan is what was asked for: printed with -q too


_exit_collections_skipped = False


def skip_exit_collections() -> None:
    """Have this process's exit leave the objects that exist then to the OS: `gc.freeze` at
    exit moves them out of the interpreter's last garbage collections, which otherwise walk
    every object that importing torch made (about 170,000: 0.5-0.8 s of CPU on a 2-core
    machine, after the conversion is done). Objects are still freed by reference counting
    and every atexit handler runs; only cycles left at exit are not collected, and the
    command relies on none of them (its files are closed and OUT renamed into place before
    it returns). Registered once per process; in a program that calls `run_convert` many times
    it acts only when that program exits."""
    global _exit_collections_skipped
    if not _exit_collections_skipped:
        atexit.register(gc.freeze)
        _exit_collections_skipped = True


def run_convert(src: str | Path, out: str | Path, *, device: str = "auto",
                refit: Iterable[str] | Mapping[str, Any] | RefitOptions | None = None, gguf_type: str | None = None,
                overwrite: bool = False, dry_run: bool = False, quiet: bool = False, shard_size_given: bool = False,
                **fields: Any) -> Path | list[str]:
    """What `gqakit convert SRC OUT` does, given its settings (`fields`: `ConvertSettings`' fields
    but `source`; `refit`: the `--refit-option KEY=VALUE` items, or a mapping), as `gqakit.convert`
    calls it too. Returns OUT, or with `dry_run` the lines of the plan (nothing written). `quiet`
    sets the run context (`core.run`) that every bar and message of the conversion reads."""
    from gqakit.core.device import check_device

    ref = resolve_model_ref(str(src))  # a Hub id: its snapshot in the Hugging Face cache
    src, out = ref.path, Path(out)
    precheck_source(src)
    check_device(device)
    # the one place --refit-option is parsed
    refit = (RefitOptions.parse(refit) if isinstance(refit, (Mapping, RefitOptions))
             else RefitOptions.from_cli(refit or ()))
    to_gguf = out.suffix.lower() == ".gguf"
    if to_gguf:
        if fields.get("dtype", "auto") != "auto":
            raise GqakitError("--dtype applies to a model folder; for a .gguf OUT use --gguf-type")
        if shard_size_given:
            raise GqakitError("--max-shard-size applies to a model folder; a .gguf OUT is one file")
        fields["max_shard_size"] = None
        if fields.get("kv_budget") is not None:
            raise GqakitError("--kv-budget writes a model folder; a .gguf OUT takes -g G")
    elif gguf_type is not None:
        raise GqakitError("--gguf-type applies only to an OUT ending in .gguf")
    settings = ConvertSettings(source=src, source_hub=ref.record(), refit=refit, **fields)
    config = _folder_config(src)
    if config is not None and archmod.find(config) is not None:  # (make_plan asks again, for every caller)
        spec = archmod.lookup(config)
        if settings.kv_budget is None and not to_gguf:  # -g or --kv-plan against the heads, before the heavy imports
            check_geometry(spec, config, settings, gguf_out=False, gguf_in=False)
        else:
            check_encoder_decoder(spec, settings, gguf=to_gguf)
    from gqakit.core.quiet import quiet_libraries
    from gqakit.core.run import running

    with running(quiet=quiet):
        if to_gguf:
            from gqakit.convert.pipeline import convert_gguf_file

            with quiet_libraries(quiet):
                return convert_gguf_file(settings, out, gguf_type=gguf_type, overwrite=overwrite, device=device,
                                         dry_run=dry_run)
        if not dry_run:  # before the heavy imports (convert_folder checks it again, as every caller's run does)
            check_output_path(out, overwrite=overwrite, inputs=settings.inputs)
        from gqakit.convert.pipeline import convert_folder, dry_run_lines

        if dry_run:
            return dry_run_lines(settings, device=device, out=out, overwrite=overwrite)
        with quiet_libraries(quiet):
            return convert_folder(settings, out, overwrite=overwrite, device=device)


def _folder_config(src: Path) -> dict[str, Any] | None:
    """config.json of a model folder SRC (None for a .gguf file or no folder)."""
    from gqakit.core.loading import read_config_json

    src = Path(src).expanduser()
    return read_config_json(src) if src.is_dir() and (src / "config.json").is_file() else None


def precheck_source(src: Path) -> None:
    """The checks of SRC that need no torch: a missing path, a broken config.json or
    safetensors header, a damaged GGUF are answered before the heavy imports."""
    from gqakit.core.loading import check_gguf, check_source_path, check_weights, read_config_json

    src = Path(src).expanduser()
    check_source_path(src)
    if src.is_file():
        check_gguf(src)
    else:
        read_config_json(src)
        check_weights(src)


@click.command("inspect", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--batch", type=int, default=1, show_default=True, help="Batch size for the KV-cache size column.")
@click.option("--context", type=int, default=None, help="Context length for the KV-cache size column [default: the model's max positions].")
@click.option("--input-len", type=int, default=None,
              help=f"Encoder-decoders: input tokens per sequence, which the cross-attention cache holds "
                   f"[default: {SEQ2SEQ_INPUT_LEN}].")
@click.option("--output-len", type=int, default=None,
              help=f"Encoder-decoders: output tokens per sequence, which the self-attention cache holds "
                   f"[default: {SEQ2SEQ_OUTPUT_LEN}].")
@click.option("--dtype-bytes", type=int, default=None,
              help="Bytes per cached element (2 for bf16/fp16) [default: the model's saved dtype, else 2].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--kv-budget", default=None, metavar="B",
              help="Also choose each layer's KV heads under B, a fraction of SRC's KV cache (0.5) or bytes per "
                   "token (12KiB), as `convert --kv-budget` would; this measures each layer on calibration text.")
@click.option("--calibration-data", default=None, help="With --kv-budget: the calibration text, as for convert "
              "[default: text sampled from SRC].")
@click.option("--calibration-tokens", type=int, default=None, help="With --kv-budget: tokens of calibration text "
              "[default: convert's].")
@click.option("--method", default=None, help="With --kv-budget: the conversion method whose candidates are "
              "measured, as for convert [default: convert's].")
@click.option("--device", default="auto", show_default=True, help="With --kv-budget: where the damage is measured.")
def inspect_cmd(src: Path, batch: int, context: int | None, input_len: int | None, output_len: int | None,
                dtype_bytes: int | None, as_json: bool, kv_budget: str | None, calibration_data: str | None,
                calibration_tokens: int | None, method: str | None, device: str) -> None:
    """Show a model's attention geometry and the KV cache at each valid G.

    SRC is a model folder, a .gguf file or a Hub id org/name[@revision] in the Hugging Face cache.

    For an encoder-decoder: both caches of the decoder (self-attention, per output token;
    cross-attention, per input token) and the bytes saved at --input-len, --output-len and
    --batch.

    \b
    Examples:
      gqakit inspect ./llama-mha
      gqakit inspect ./llama-mha --batch 16 --context 8192
      gqakit inspect ./t5-base --input-len 4096 --output-len 256 --batch 8
      gqakit inspect ./llama-mha --kv-budget 0.25 --calibration-data calib.txt

    With --kv-budget, also the per-layer plan `convert --kv-budget` would write, its cache size
    and each layer's measured damage; it loads SRC and runs every layer's candidates over the
    calibration text (the time is printed), and writes nothing.
    """
    if batch < 1 or any(v is not None and v < 1 for v in (context, input_len, output_len, dtype_bytes)):
        raise GqakitError("--batch, --context, --input-len, --output-len and --dtype-bytes must be positive")
    budget_opts = {k: v for k, v in (("calibration_data", calibration_data), ("calibration_tokens",
                   calibration_tokens), ("method", method)) if v is not None}
    if kv_budget is None and budget_opts:
        raise GqakitError(f"--{next(iter(budget_opts)).replace('_', '-')} applies with --kv-budget")
    ref = resolve_model_ref(src)  # a Hub id: its snapshot in the Hugging Face cache
    src = ref.path
    precheck_source(src)
    name = ref.hub_id or str(src)
    budget = None if kv_budget is None else ConvertSettings(source=src, kv_budget=kv_budget, **budget_opts)
    from gqakit.convert.plan import make_plan
    from gqakit.convert.source import open_model

    opened = open_model(src, progress=False)
    spec = archmod.lookup(opened.config)
    saved = config_dtype(opened.config)
    if dtype_bytes is None:  # the cache in the dtype the weights are saved (and load) in
        dtype_bytes = DTYPE_BYTES[saved] if saved else 2
    dtype = dtype_label(dtype_bytes, saved if saved and DTYPE_BYTES[saved] == dtype_bytes else None)
    if spec.is_encoder_decoder:
        if budget is not None:
            raise GqakitError(f"--kv-budget is for decoder-only models; {spec.family} is an encoder-decoder")
        if context is not None:
            raise GqakitError("--context applies to decoder-only models; for an encoder-decoder give --input-len "
                              "and --output-len")
        _inspect_seq2seq(src, name, opened, batch, input_len or SEQ2SEQ_INPUT_LEN, output_len or SEQ2SEQ_OUTPUT_LEN,
                         dtype_bytes, dtype, as_json)
        return
    if input_len is not None or output_len is not None:
        raise GqakitError(f"--input-len and --output-len apply to encoder-decoders; {spec.family} is decoder-only "
                          "(use --context)")
    s = archmod.shape_of(spec, opened.config)
    ctx = context or s.max_positions or 2048
    rows = []
    top = math.gcd(*(s.kv_heads_of(L) for L in range(s.num_layers)))  # a G every layer can take
    for g in [d for d in range(top, 0, -1) if top % d == 0]:
        plan = make_plan(opened, ConvertSettings(source=src, num_kv_heads=g, force=True))
        per_tok = s.kv_bytes_per_token(dtype_bytes, g)
        rows.append({"kv_heads": g, "group_size": s.num_heads // g, "kv_bytes_per_token": per_tok,
                     "kv_cache_bytes": per_tok * batch * ctx,
                     "parameters_removed": plan.source_params - plan.output_params})
    info = {"source": name, "family": spec.family, "native_gqa": spec.native_gqa, "layers": s.num_layers,
            "query_heads": s.num_heads, "kv_heads": list(s.kv_heads_per_layer or ()) or s.num_kv_heads,
            "head_dim": s.head_dim, "hidden_size": s.hidden_size, "rotary_dim": s.rotary_dim,
            "parameters": make_plan(opened, ConvertSettings(source=src, num_kv_heads=top, force=True)).source_params,
            "batch": batch, "context": ctx, "dtype_bytes": dtype_bytes, "dtype": dtype, "options": rows}
    choice = None
    if budget is not None:
        from gqakit.convert.budget.choose import choose_kv_heads
        from gqakit.core.device import check_device, resolve_device

        check_device(device)
        choice = choose_kv_heads(opened, budget, device=resolve_device(device), progress=not as_json)
        info["kv_budget"] = {"budget": str(budget.kv_budget), **choice.record()}
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"{name}: {spec.family} ({'stock GQA support' if spec.native_gqa else 'GQA via written modeling file'})")
    click.echo(f"  layers {s.num_layers}, hidden {s.hidden_size}, query heads {s.num_heads}, KV heads "
               f"{info['kv_heads']}, head_dim {s.head_dim}, parameters {info['parameters']:,}")
    click.echo(f"\n  KV cache at batch {batch}, context {ctx}, {dtype_bytes} bytes/element ({dtype}):")
    click.echo(f"  {'G':>4} {'q/kv':>5} {'KV bytes/token':>28} {'KV cache':>14} {'params removed':>15}")
    for r in rows:
        click.echo(f"  {r['kv_heads']:>4} {r['group_size']:>5} {kv_bytes_text(r['kv_bytes_per_token'], dtype):>28} "
                   f"{format_bytes(r['kv_cache_bytes']):>14} {r['parameters_removed']:>15,}")
    if choice is not None:
        click.echo(f"\n  --kv-budget {budget.kv_budget}: KV heads per layer {list(choice.kv_heads)}")
        for line in choice.lines():
            click.echo(line)


def _inspect_seq2seq(src: Path, name: str, opened: Any, batch: int, input_len: int, output_len: int,
                     dtype_bytes: int, dtype: str, as_json: bool) -> None:
    """`inspect` of an encoder-decoder: the decoder's two caches at every valid G (the encoder
    keeps no cache), and what each G saves at this input length, output length and batch."""
    from gqakit.convert.plan import make_plan

    spec = archmod.lookup(opened.config)
    geo = archmod.Seq2SeqShape(archmod.encoder_shape_of(spec, opened.config), archmod.shape_of(spec, opened.config))
    dec, enc = geo.decoder, geo.encoder
    full = [b * batch for b in geo.cache_bytes(dtype_bytes, input_tokens=input_len, output_tokens=output_len)]
    rows = []
    for g in [d for d in range(dec.num_kv_heads, 0, -1) if dec.num_kv_heads % d == 0]:
        plan = make_plan(opened, ConvertSettings(source=src, num_kv_heads=g, force=True))
        self_b, cross_b = (b * batch for b in geo.cache_bytes(dtype_bytes, input_tokens=input_len,
                                                               output_tokens=output_len, kv_heads=g))
        rows.append({"kv_heads": g, "group_size": dec.num_heads // g,
                     "self_attention_bytes_per_output_token": dec.kv_bytes_per_token(dtype_bytes, g),
                     "cross_attention_bytes_per_input_token": dec.kv_bytes_per_token(dtype_bytes, g),
                     "self_attention_cache_bytes": self_b, "cross_attention_cache_bytes": cross_b,
                     "kv_cache_bytes": self_b + cross_b, "kv_cache_bytes_saved": sum(full) - self_b - cross_b,
                     "parameters_removed": plan.source_params - plan.output_params})
    info = {"source": name, "family": spec.family, "native_gqa": spec.native_gqa, "encoder_decoder": True,
            "encoder": {"layers": enc.num_layers, "query_heads": enc.num_heads, "kv_heads": enc.num_kv_heads,
                        "head_dim": enc.head_dim},
            "decoder": {"layers": dec.num_layers, "query_heads": dec.num_heads, "kv_heads": dec.num_kv_heads,
                        "head_dim": dec.head_dim},
            "hidden_size": dec.hidden_size, "parameters": plan.source_params, "batch": batch,
            "input_len": input_len, "output_len": output_len, "dtype_bytes": dtype_bytes, "dtype": dtype,
            "options": rows}
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"{name}: {spec.family} encoder-decoder (GQA via written modeling file)")
    click.echo(f"  encoder: layers {enc.num_layers}, query heads {enc.num_heads}, KV heads {enc.num_kv_heads}; "
               f"decoder: layers {dec.num_layers}, query heads {dec.num_heads}, KV heads {dec.num_kv_heads}; "
               f"head_dim {dec.head_dim}, hidden {dec.hidden_size}, parameters {plan.source_params:,}")
    click.echo(f"\n  decoder KV caches at batch {batch}, input {input_len} tokens, output {output_len} tokens, "
               f"{dtype_bytes} bytes/element ({dtype}; self-attention per output token, cross-attention per input "
               "token):")
    click.echo(f"  {'G':>4} {'q/kv':>5} {'KV bytes/token':>28} {'self cache':>12} {'cross cache':>12} "
               f"{'saved':>12} {'params removed':>15}")
    for r in rows:
        click.echo(f"  {r['kv_heads']:>4} {r['group_size']:>5} "
                   f"{kv_bytes_text(r['self_attention_bytes_per_output_token'], dtype):>28} "
                   f"{format_bytes(r['self_attention_cache_bytes']):>12} "
                   f"{format_bytes(r['cross_attention_cache_bytes']):>12} "
                   f"{format_bytes(r['kv_cache_bytes_saved']):>12} {r['parameters_removed']:>15,}")
