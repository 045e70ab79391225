"""What a conversion is asked to do: `ConvertSettings` and its `RefitOptions`, validated once.

Every value is parsed and checked where it enters (the CLI or a Python call), and
everything below receives these typed, frozen objects: no function re-parses a string it
was handed. Every default lives here, once. The CLI's flags and `--help`, and the README's
table of align-refit options, are generated from (or tested against) the fields below.

This module imports neither torch nor the conversion math, so that the CLI checks its
input before the heavy imports.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictFloat, StrictInt, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from gqakit.core.arch import ArchSpec
from gqakit.core.errors import GqakitError
from gqakit.core.text import TextSource
from gqakit.core.units import COMPUTE_DTYPES, parse_size

# The default method, chosen from the numbers (docs/benchmarks.md, README "Methods"): of the
# methods that need nothing but the checkpoint and take seconds, `align` beats the paper's
# `mean` on every model measured, before and after equal-budget uptraining.
DEFAULT_METHOD = "align"
# Calibration memory does not grow with the token count times the depth (one block and two
# hidden-state streams at a time), so the default budget is set by time, not memory:
# docs/benchmarks.md shows align-refit keeps improving well past 16k tokens.
DEFAULT_CALIBRATION_TOKENS = 65536
DTYPE_NAMES = COMPUTE_DTYPES
SMALL_MODEL = 20_000_000  # parameters: below this, CPU calibration computes in float64

# What align-refit's "auto" settings resolve to (`ConvertSettings.resolved`), from the
# measurements in docs/benchmarks.md ("Recommended conversion"). On SmolLM2-135M, 400 steps at
# lr 0.01 on q, k, v, o; on stories260K, 4,500 steps at lr 0.007 on the whole block with
# similarity grouping: each the best measured for its size.
EFFORTS = ("fast", "best")
MAX_SEQ_LEN = 512  # calibration sequences: the model's context, at most the context evaluated at
REFERENCE_TOKENS = 65536  # the steps below are for this many calibration tokens; fewer in proportion
BEST = {"small": {"steps": 4500, "lr": 0.007, "train": "block", "grouping": "similarity"},
        "large": {"steps": 400, "lr": 0.01, "train": "attention", "grouping": "contiguous"}}

Number = StrictInt | StrictFloat  # an int stays an int, so the record shows what was asked


class RefitOptions(BaseModel):
    """The settings of a calibrated conversion (`--refit-option KEY=VALUE`), with their defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    seq_len: Literal["auto"] | StrictInt = Field(
        "auto", ge=2, description=f"tokens per calibration sequence (auto: the model's context, at most {MAX_SEQ_LEN})")
    batch: Literal["auto"] | StrictInt = Field(
        "auto", ge=1, description="sequences per block forward (auto: 4 on the CPU, 8 on a GPU, fewer for "
                                  "sequences over 256 tokens: at most 1,024 and 2,048 tokens)")
    sample_batch: StrictInt = Field(
        64, ge=1, description="sequences per generate call when calibration text is sampled from SRC")
    q_ridge: Number = Field(1e-2, description="ridge strength of the query refit, relative to the mean diagonal "
                                             "of its normal matrix; < 0 skips that refit")
    o_ridge: Number = Field(3e-2, description="ridge strength of the o_proj refit, relative to the mean diagonal "
                                             "of its normal matrix; < 0 skips that refit")
    target: Literal["residual", "local"] = Field(
        "residual", description="what o_proj is refitted towards: the original model's residual stream after "
                                "the attention (residual) or the original attention output (local)")
    skip_first: StrictInt = Field(0, ge=0, description="leave the first n positions of every sequence out of the fits")
    row_weight: Literal["relative", "none"] = Field(
        "relative", description="o_proj rows weighted by 1/|original residual|^2, so that outsized rows do not "
                                "dominate (relative), or all alike (none)")
    holdout: Number = Field(0.0, ge=0, lt=1, description="fraction of the sequences kept out of the fits; the "
                                                         "reported residual drift is then measured on them")
    dtype: Literal["auto", "float32", "float64"] = Field(
        "auto", description="block compute dtype: auto (float64 for models under 20M parameters on the CPU, "
                            "else float32), float32 or float64")
    stream_dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = Field(
        "auto", description="storage dtype of the two hidden-state streams: auto (the compute dtype), float32, "
                            "float64, bfloat16 or float16")
    offload: Literal["auto", "device", "cpu", "disk"] = Field(
        "auto", description="where the streams live: device, cpu (host memory), disk (files beside OUT) or auto "
                            "(the device when they fit, else host memory, else disk)")
    checkpoint_seconds: Number = Field(
        120.0, ge=0, description="how often, at most, the streams and the finished layers are saved, so that a "
                                 "killed run resumes")
    steps: Literal["auto"] | StrictInt = Field(
        "auto", ge=0, description=f"block-wise reconstruction: Adam steps per layer (0: closed-form fits only; auto: "
                                  f"{BEST['large']['steps']}, or {BEST['small']['steps']} for a model under "
                                  f"{SMALL_MODEL // 10**6}M parameters, fewer in proportion below "
                                  f"{REFERENCE_TOKENS:,} calibration tokens; 0 with --effort fast)")
    lr: Literal["auto"] | Number = Field(
        "auto", gt=0, description=f"the steps' learning rate, relative to each tensor's RMS (decaying linearly to 0; "
                                  f"auto: {BEST['large']['lr']}, or {BEST['small']['lr']} for a model under "
                                  f"{SMALL_MODEL // 10**6}M parameters)")
    guard_spans: StrictInt = Field(8, ge=1, description="batches of sequences the guard measures on (it keeps the "
                                                        "closed-form fit when the steps do not help)")
    train: Literal["auto", "attention", "block"] = Field(
        "auto", description="what the steps train: q, k, v and o (attention) or every weight of the block, "
                            f"MLP and norms too (block; model-folder output only; auto: {BEST['small']['train']} for "
                            f"a model under {SMALL_MODEL // 10**6}M parameters written to a folder, else "
                            f"{BEST['large']['train']})")

    _given: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _keep_order(cls, data: Any, handler: Any) -> RefitOptions:
        model = handler(data)
        if isinstance(data, Mapping):
            model._given = tuple(data)
        return model

    @classmethod
    def parse(cls, options: Mapping[str, Any] | RefitOptions | None) -> RefitOptions:
        """`options` validated; an unknown key or a bad value is a one-line `GqakitError`."""
        if isinstance(options, RefitOptions):
            return options
        options = dict(options or {})
        unknown = [k for k in options if k not in cls.model_fields]
        if unknown:
            raise GqakitError(f"unknown align-refit option(s) {', '.join(sorted(unknown))}; "
                              f"known: {', '.join(cls.model_fields)}")
        try:
            return cls(**options)
        except ValidationError as e:
            key = str(e.errors()[0]["loc"][0])
            raise GqakitError(_option_error(key, options[key])) from None

    @classmethod
    def from_cli(cls, items: Iterable[str]) -> RefitOptions:
        """`--refit-option KEY=VALUE` items: values are read as JSON where they parse (numbers), else as text."""
        out: dict[str, Any] = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise GqakitError(f"--refit-option expects KEY=VALUE, got {item!r}")
            try:
                out[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                out[key.strip()] = value
        return cls.parse(out)

    def given(self) -> dict[str, Any]:
        """The options that were asked for, in the order they were given (the rest are defaults)."""
        return {k: getattr(self, k) for k in self._given}

    def train_steps(self, kv_from: int | None = None, kv_to: int | None = None) -> int:
        """Block-wise reconstruction steps per layer: none when the conversion keeps every K/V head
        (kv_to >= kv_from: it is exact); with the head counts unknown (None), the steps asked for."""
        if kv_from is not None and kv_to is not None and kv_to >= kv_from:
            return 0
        return 0 if self.steps == "auto" else self.steps

    def trains_block(self, kv_from: int | None = None, kv_to: int | None = None) -> bool:
        """Whether the steps train every weight of each converted block (`train=block` with steps),
        so that the writer takes the blocks' MLP and norms from the calibration stage."""
        return self.train_steps(kv_from, kv_to) > 0 and self.train == "block"


def _option_error(key: str, value: Any) -> str:
    """The one line for a refused align-refit option, from the field's type and limits."""
    field = RefitOptions.model_fields[key]
    kinds = _base_types(field.annotation)
    limits = {name: getattr(m, name) for m in field.metadata for name in ("gt", "ge", "lt") if hasattr(m, name)}
    auto = " or auto" if "auto" in _choices(field) else ""
    if float in kinds:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"align-refit option {key} must be a finite number{auto}, got {value!r}"
        if "ge" in limits and "lt" in limits:
            return f"align-refit option {key} must be in [{limits['ge']}, {limits['lt']}), got {value!r}"
        op = ">" if "gt" in limits else ">="
        return f"align-refit option {key} must be {op} {limits.get('gt', limits.get('ge'))}{auto}, got {value!r}"
    if int in kinds:
        return f"align-refit option {key} must be an integer >= {limits['ge']}{auto}, got {value!r}"
    return f"align-refit option {key}={value!r}; choose from {', '.join(_choices(field))}"


def _base_types(annotation: Any) -> set[Any]:
    """The plain types inside an annotation (through unions and Annotated)."""
    args = get_args(annotation)
    if not args:
        return {annotation}
    return set().union(*(_base_types(a) for a in args if not isinstance(a, str)))


def _choices(field: Any) -> list[str]:
    """The strings a Literal field (or a Literal inside a union) accepts."""
    return [c for a in (field.annotation, *get_args(field.annotation)) for c in get_args(a) if isinstance(c, str)]


def _cli(*decls: str, **kw: Any) -> dict[str, Any]:
    """How a settings field appears on the command line (read by `convert.cli`)."""
    return {"cli": {"decls": list(decls), **kw}}


class ConvertSettings(BaseModel):
    """Everything that determines a conversion; recorded in OUT (`record()`).

    Built once, by the CLI or by `pipeline.convert_checkpoint` / `convert_gguf`, and handed
    down as it is. The checks that need no model run here, in this order: method, grouping,
    the align-refit options, calibration tokens and data, dtype, shard size."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    source: str = Field(description="the source checkpoint: a model folder or a .gguf file (a Hub id given "
                                    "here is resolved to its snapshot folder in the Hugging Face cache)")
    source_hub: dict[str, str] | None = Field(
        None, description="where SRC came from when it was given as a Hub id: repo_id, revision, commit "
                          "(core.hub.ModelRef.record); None for a local path")
    num_kv_heads: int = Field(description="Target number of K/V heads G (must divide the current number).",
                              json_schema_extra=_cli("-g", "--num-kv-heads", type=int, required=True))
    method: str = Field(
        DEFAULT_METHOD, json_schema_extra=_cli("--method", show_default=True),
        description="How each group's K/V heads become one: mean (the GQA paper); first, random (its ablations); "
                    "align (RoPE-aware head alignment, then mean; no data); align-scale (align + logit-scale "
                    "restoration; no data); align-refit (align, then fits on calibration text; best quality).")
    grouping: str = Field(
        "auto", json_schema_extra=_cli("--grouping", show_default=True),
        description="Which heads share a group: contiguous (the paper), similarity (balanced groups of the most "
                    "similar heads) or auto (similarity for align-refit under 20M parameters, else contiguous).")
    effort: Literal["fast", "best"] = Field(
        "best", json_schema_extra=_cli("--effort", choices=EFFORTS, show_default=True),
        description="best: the closed-form fits, then block-wise reconstruction with the steps, lr and train "
                    "chosen for the model's size; fast: the closed-form fits only (steps=0). What each costs: "
                    "docs/benchmarks.md.")
    refit: RefitOptions = Field(default_factory=RefitOptions,
                                description="settings of a method that calibrates (--refit-option KEY=VALUE)")
    calibration_tokens: int = Field(
        DEFAULT_CALIBRATION_TOKENS, json_schema_extra=_cli("--calibration-tokens", type=int, show_default=True),
        description="Tokens of calibration text; time grows with them, memory does not.")
    calibration_data: str | None = Field(
        None, json_schema_extra=_cli("--calibration-data"),
        description="A text file, or hf:NAME[:CONFIG][:SPLIT] from the local datasets cache (never your "
                    "evaluation text) [default: text sampled from SRC, which needs the whole model in memory once].")
    dtype: str = Field("auto", json_schema_extra=_cli("--dtype", choices=("auto", *DTYPE_NAMES), show_default=True),
                       description="Output dtype; auto keeps each tensor's dtype.")
    max_shard_size: str | None = Field(
        "2GB", json_schema_extra=_cli("--max-shard-size", show_default=True),
        description="Largest output shard, e.g. 500MB.")
    seed: int = Field(0, json_schema_extra=_cli("--seed", type=int, show_default=True),
                      description="Seed for random methods.")
    group_encoder: bool = Field(
        False, json_schema_extra=_cli("--group-encoder", is_flag=True),
        description="Encoder-decoders: group the encoder's self-attention too. By default only the decoder's "
                    "attentions are grouped (the GQA paper): the encoder runs once per input, over its tokens in "
                    "parallel, so it is not bound by memory bandwidth.")

    force: bool = Field(
        False, json_schema_extra=_cli("--force", is_flag=True),
        description="Write OUT even when -g equals SRC's KV heads, which groups nothing (an unchanged copy).")

    @model_validator(mode="before")
    @classmethod
    def _hub_source(cls, data: Any) -> Any:
        """A `source` that is no local path but a Hub id: its snapshot folder in the cache."""
        if isinstance(data, dict) and data.get("source") is not None and data.get("source_hub") is None:
            from gqakit.core.hub import resolve_model_ref

            ref = resolve_model_ref(data["source"])
            if ref.repo_id is not None:
                data = {**data, "source": ref.path, "source_hub": ref.record()}
        return data

    @field_validator("source", mode="before")
    @classmethod
    def _resolved(cls, v: Any) -> str:
        return str(Path(v).expanduser().resolve())

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        from gqakit.convert.methods import method_spec  # the method table (imports the math)

        method_spec(v)
        return v

    @field_validator("grouping")
    @classmethod
    def _known_grouping(cls, v: str) -> str:
        from gqakit.convert.grouping import GROUPINGS

        if v != "auto" and v not in GROUPINGS:
            raise GqakitError(f"unknown grouping {v!r}; choose from auto, {', '.join(GROUPINGS)}")
        return v

    @field_validator("refit", mode="before")
    @classmethod
    def _refit_options(cls, v: Any, info: ValidationInfo) -> RefitOptions:
        given = v.given() if isinstance(v, RefitOptions) else dict(v or {})
        if given and not needs_data(info.data["method"]):
            raise GqakitError(f"method {info.data['method']} takes no options (got {', '.join(given)})")
        return RefitOptions.parse(v)

    @field_validator("calibration_tokens")
    @classmethod
    def _tokens(cls, v: int, info: ValidationInfo) -> int:
        if needs_data(info.data.get("method", "")) and v < 1:
            raise GqakitError(f"--calibration-tokens must be at least 1, got {v}")
        return v

    @field_validator("calibration_data")
    @classmethod
    def _data(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v and needs_data(info.data.get("method", "")):
            TextSource(v).check_exists("calibration data")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v != "auto" and v not in DTYPE_NAMES:
            raise GqakitError(f"unknown dtype {v!r}; choose auto, {', '.join(DTYPE_NAMES)}")
        return v

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _shard_size(cls, v: Any) -> str | None:
        if v is None:
            return None
        if parse_size(v) < 1:
            raise GqakitError(f"--max-shard-size must be more than 0 bytes, got {v!r}")
        return str(v)

    _auto: dict[str, str] | None = PrivateAttr(default=None)  # set by `resolved`: what "auto" chose, and why

    def resolved(self, *, source_params: int, max_positions: int | None, gguf_out: bool = False) -> ConvertSettings:
        """The settings with every "auto" decided from the model's geometry (parameters and
        context) and the output kind, once, at plan time; explicit values are kept as given.
        `auto_reasons()` then says what was chosen and why. Resolving twice changes nothing."""
        if self._auto is not None:
            return self
        reasons: dict[str, str] = {}
        grouping, refit = self.grouping, self.refit
        small = source_params < SMALL_MODEL
        count = f"{source_params / 1e6:,.0f}M" if source_params >= 10**7 else f"{source_params:,}"
        size = f"{count} parameters, {'under' if small else 'at least'} 20M"
        best = BEST["small" if small else "large"]
        if self.staged:
            r: dict[str, Any] = {}
            if grouping == "auto":
                grouping = best["grouping"]
                reasons["grouping"] = f"auto: {grouping} ({size})"
            if refit.seq_len == "auto":
                r["seq_len"] = min(MAX_SEQ_LEN, max_positions or MAX_SEQ_LEN)
                reasons["seq_len"] = (f"auto: {r['seq_len']} (the model's context {max_positions}, at most "
                                      f"{MAX_SEQ_LEN})" if max_positions else f"auto: {r['seq_len']}")
            if refit.steps == "auto":
                if self.effort == "fast":
                    r["steps"] = 0
                    reasons["steps"] = "auto: 0 (--effort fast: the closed-form fits only)"
                else:
                    share = min(1.0, self.calibration_tokens / REFERENCE_TOKENS)
                    r["steps"] = max(1, round(best["steps"] * share))
                    reasons["steps"] = f"auto: {r['steps']} (--effort best, {size}" + (
                        f"; {best['steps']} scaled to {self.calibration_tokens:,} of {REFERENCE_TOKENS:,} "
                        "calibration tokens)" if share < 1 else ")")
            if refit.lr == "auto":
                r["lr"] = best["lr"]
                reasons["lr"] = f"auto: {r['lr']} ({size})"
            if refit.train == "auto":
                r["train"] = "attention" if gguf_out else best["train"]
                reasons["train"] = f"auto: {r['train']} (" + ("a .gguf OUT keeps the other tensors' bytes)"
                                                              if gguf_out else f"{size})")
            if r:
                given = refit._given
                refit = refit.model_copy(update=r)
                refit._given = given
        elif grouping == "auto":
            grouping = "contiguous"
        out = self.model_copy(update={"grouping": grouping, "refit": refit})
        out._auto = reasons
        return out

    def auto_reasons(self) -> dict[str, str]:
        """What each "auto" setting resolved to, and why ({} before `resolved`)."""
        return dict(self._auto or {})

    @property
    def staged(self) -> bool:
        """True when the method calibrates on data: the calibration stage makes its layers."""
        return needs_data(self.method)

    @property
    def max_shard_bytes(self) -> int:
        assert self.max_shard_size is not None, "a GGUF output is one file"
        return parse_size(self.max_shard_size)

    @property
    def calibration_file(self) -> Path | None:
        """The calibration text as a file (an input no output may touch); None for hf: or none."""
        return TextSource(self.calibration_data).file if self.calibration_data else None

    def record(self) -> dict[str, Any]:
        """The settings as written to OUT (gqakit_convert.json, the card, GGUF metadata and the
        resume fingerprint): the options as given, and "-" for a shard size that does not apply."""
        return {"source": self.source, "num_kv_heads": self.num_kv_heads, "method": self.method,
                "grouping": self.grouping, "dtype": self.dtype,
                "max_shard_size": "-" if self.max_shard_size is None else self.max_shard_size,
                "seed": self.seed, "calibration_data": self.calibration_data,
                "calibration_tokens": self.calibration_tokens, "options": self.refit.given(),
                **({"group_encoder": True} if self.group_encoder else {}),
                **({"source_hub": dict(self.source_hub)} if self.source_hub else {}), **self._resolved_record()}

    @property
    def source_name(self) -> str:
        """How the source is named to others (model card, title): its Hub id (`org/name`, with
        `@revision` unless main) when it came from the Hub, else the folder or file name."""
        h = self.source_hub
        if h:
            return h["repo_id"] + (f"@{h['revision']}" if h.get("revision", "main") != "main" else "")
        return Path(self.source).name

    def _resolved_record(self) -> dict[str, Any]:
        """For a resolved calibrating method: the effort, the values "auto" chose (after the given
        options) and the reasons, so the record states every setting that shaped the result."""
        if not self.staged or self._auto is None:
            return {}
        chosen = {k: getattr(self.refit, k) for k in self._auto if k in RefitOptions.model_fields}
        return {"effort": self.effort, "options": {**self.refit.given(), **chosen}, "auto": dict(self._auto)}


def check_encoder_decoder(spec: ArchSpec, settings: ConvertSettings, *, gguf: bool) -> None:
    """What a conversion of an encoder-decoder cannot do, each refused in one line (and
    --group-encoder on a model without an encoder). Needs no torch: the CLI asks it first."""
    if not spec.is_encoder_decoder:
        if settings.group_encoder:
            raise GqakitError(f"--group-encoder applies to encoder-decoder models; a {spec.family} model has "
                              "no encoder")
        return
    if settings.staged:
        raise GqakitError(f"method {settings.method} calibrates through the model, which is not implemented for "
                          f"encoder-decoders ({spec.family}): it would run the encoder once and stream the "
                          "decoder block by block with teacher-forced targets; use mean, first, random or align")
    if gguf:
        raise GqakitError(f"GGUF input and output are for decoder-only models; convert the {spec.family} "
                          "encoder-decoder from its model folder to a model folder")


def needs_data(method: str) -> bool:
    from gqakit.convert.methods import METHODS

    return method in METHODS and METHODS[method].needs_data


def refit_options_markdown() -> str:
    """The README's table of align-refit options (`tests/test_convert_settings.py` keeps them equal)."""
    rows = ["| option | default | what |", "|---|---|---|"]
    for key, f in RefitOptions.model_fields.items():
        rows.append(f"| `{key}` | `{f.default}` | {f.description.replace('|', '&#124;')} |")
    return "\n".join(rows)


def auto_settings_markdown() -> str:
    """The README's table of what align-refit's "auto" settings resolve to (`ConvertSettings.resolved`;
    `tests/test_convert_settings.py` keeps them equal)."""
    rows = ["| model | `--grouping` | `seq_len` | `steps` at 65,536 tokens | `lr` | `train` |",
            "|---|---|---|---|---|---|"]
    for key, what in (("small", "under 20M parameters"), ("large", "20M parameters or more")):
        b = BEST[key]
        rows.append(f"| {what} | {b['grouping']} | the model's context, at most {MAX_SEQ_LEN} | {b['steps']:,} | "
                    f"{b['lr']} | {b['train']} |")
    return "\n".join(rows)


def refit_options_help() -> str:
    """The `--help` section listing every align-refit option with its default."""
    lines = ["\b", "align-refit options (--refit-option KEY=VALUE, repeatable; KEY=default: what):"]
    for key, f in RefitOptions.model_fields.items():
        lines += textwrap.wrap(f"{key}={f.default}: {f.description}", width=78, initial_indent="  ",
                               subsequent_indent="      ", break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines)
