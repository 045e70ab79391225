"""What a conversion is asked to do: `ConvertSettings`, validated once.

Every value is parsed and checked where it enters (the CLI or a Python call), and
everything below receives these typed, frozen objects: no function re-parses a string it
was handed. Every default lives here, once. The CLI's flags and `--help` are generated from
the fields below; the method's options are its own model (`core.methods`: align-refit's
`refit_options.RefitOptions`). `make_plan` turns these settings into `resolved.ResolvedSettings`,
where nothing is "auto" any more.

This module imports neither torch nor the conversion math (the method table is
`core.methods`), so that the CLI checks its input before the heavy imports.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gqakit.convert.budget.kvbudget import KvBudget
from gqakit.core.arch import ArchSpec
from gqakit.core.errors import GqakitError
from gqakit.core.methods import GROUPING_NAMES, load, method_spec
from gqakit.core.text import TextSource
from gqakit.core.units import COMPUTE_DTYPES, parse_size

# The default method, chosen from the numbers (docs/benchmarks.md, README "Methods"): of the
# methods that need nothing but the source weights and take seconds, `align` beats the paper's
# `mean` on every model measured, before and after equal-budget uptraining.
DEFAULT_METHOD = "align"
# Calibration memory does not grow with the token count times the depth (one block and two
# hidden-state streams at a time), so the default budget is set by time, not memory:
# docs/benchmarks.md shows align-refit keeps improving well past 16k tokens.
DEFAULT_CALIBRATION_TOKENS = 65536
DTYPE_NAMES = COMPUTE_DTYPES
EFFORTS = ("fast", "best")


class NoOptions(BaseModel):
    """The options of a method that takes none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def parse(cls, options: Mapping[str, Any] | BaseModel | None) -> NoOptions:
        return cls()

    def given(self) -> dict[str, Any]:
        return {}


def _cli(*decls: str, **kw: Any) -> dict[str, Any]:
    """How a settings field appears on the command line (read by `convert.cli`)."""
    return {"cli": {"decls": list(decls), **kw}}


class ConvertSettings(BaseModel):
    """Everything that determines a conversion; recorded in OUT (`record()`).

    Built once, by the CLI or by `pipeline.convert_checkpoint` / `convert_gguf`, and handed
    down as it is. The checks that need no model run here, in this order: method, grouping,
    the align-refit options, calibration tokens and data, dtype, shard size."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    source: str = Field(description="the source model: a model folder or a .gguf file (a Hub id given "
                                    "here is resolved to its snapshot folder in the Hugging Face cache)")
    source_hub: dict[str, str] | None = Field(
        None, description="where SRC came from when it was given as a Hub id: repo_id, revision, commit "
                          "(core.hub.ModelRef.record); None for a local path")
    num_kv_heads: int | None = Field(
        None, description="K/V heads G in every layer (divides SRC's).",
        json_schema_extra=_cli("-g", "--num-kv-heads", type=int))
    kv_budget: KvBudget | None = Field(
        None, json_schema_extra=_cli("--kv-budget", metavar="B"),
        description="Per-layer G within a KV budget: 0.5 or 12KiB.")
    kv_plan: Path | None = Field(
        None, json_schema_extra=_cli("--kv-plan", type=Path),
        description="Per-layer KV heads, from a JSON file.")
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
    refit: BaseModel = Field(  # RefitOptions for align-refit, NoOptions for a method without options
        default_factory=dict, validate_default=True,
        description="the method's options (--refit-option KEY=VALUE), as its options model (`core.methods`)")
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

    @field_validator("kv_budget", mode="before")
    @classmethod
    def _kv_budget(cls, v: Any) -> KvBudget | None:
        return None if v is None else KvBudget.parse(v)

    @field_validator("source", mode="before")
    @classmethod
    def _resolved(cls, v: Any) -> str:
        return str(Path(v).expanduser().resolve())

    @field_validator("kv_plan")
    @classmethod
    def _plan_file(cls, v: Path | None) -> Path | None:
        if v is None:
            return None
        v = Path(v).expanduser().resolve()
        read_kv_plan(v)  # its form is checked here; its fit to the model by `plan.make_plan`
        return v

    @model_validator(mode="after")
    def _one_target(self) -> "ConvertSettings":
        given = [flag for flag, v in (("-g", self.num_kv_heads), ("--kv-budget", self.kv_budget),
                                      ("--kv-plan", self.kv_plan)) if v is not None]
        if not given:
            raise GqakitError("give -g G (G KV heads in every layer), --kv-budget B (each layer's KV heads chosen "
                              "under a cache budget) or --kv-plan plan.json (each layer's KV heads from a file)")
        if len(given) > 1:
            raise GqakitError(f"{' and '.join(given)} both set the KV heads: -g gives every layer G, --kv-budget "
                              "chooses each layer's, --kv-plan reads them from a file; give one")
        return self

    @property
    def plan_heads(self) -> tuple[int, ...] | None:
        """The per-layer KV heads of `kv_plan`, or None."""
        return read_kv_plan(self.kv_plan) if self.kv_plan is not None else None

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        method_spec(v)  # the method table (imports no math)
        return v

    @field_validator("grouping")
    @classmethod
    def _known_grouping(cls, v: str) -> str:
        if v == "auto" or v in GROUPING_NAMES:
            return v
        live = sys.modules.get("gqakit.convert.grouping")  # one added at run time went into its GROUPINGS
        names = tuple(getattr(live, "GROUPINGS", GROUPING_NAMES))
        if v not in names:
            raise GqakitError(f"unknown grouping {v!r}; choose from auto, {', '.join(names)}")
        return v

    @field_validator("refit", mode="before")
    @classmethod
    def _refit_options(cls, v: Any, info: ValidationInfo) -> Any:
        given = v.given() if isinstance(v, BaseModel) else dict(v or {})
        options = method_spec(info.data["method"]).options
        if options is None:
            if given:
                raise GqakitError(f"method {info.data['method']} takes no options (got {', '.join(given)})")
            return NoOptions()
        return load(options).parse(v)

    @field_validator("calibration_tokens")
    @classmethod
    def _tokens(cls, v: int, info: ValidationInfo) -> int:
        if (needs_data(info.data.get("method", "")) or info.data.get("kv_budget")) and v < 1:
            raise GqakitError(f"--calibration-tokens must be at least 1, got {v}")
        return v

    @field_validator("calibration_data")
    @classmethod
    def _data(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v and (needs_data(info.data.get("method", "")) or info.data.get("kv_budget")):
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

    @property
    def staged(self) -> bool:
        """True when the method calibrates on data: the calibration stage makes its layers."""
        return needs_data(self.method)

    @property
    def calibration_file(self) -> Path | None:
        """The calibration text as a file (an input no output may touch); None for hf: or none."""
        return TextSource(self.calibration_data).file if self.calibration_data else None

    @property
    def inputs(self) -> list[tuple[str, Path | None]]:
        """The files OUT may not touch, each with what it is (the output rule's `inputs`)."""
        return [("source", Path(self.source)), ("calibration data", self.calibration_file)]

    def record(self) -> dict[str, Any]:
        """The settings as asked: the options as given, and "-" for a shard size that does not
        apply. What OUT records is `ResolvedSettings.record`, which adds what "auto" chose."""
        return {"source": self.source, "num_kv_heads": self.num_kv_heads,
                **({"kv_plan": str(self.kv_plan)} if self.kv_plan is not None else {}), "method": self.method,
                "grouping": self.grouping, "dtype": self.dtype,
                "max_shard_size": "-" if self.max_shard_size is None else self.max_shard_size,
                "seed": self.seed, "calibration_data": self.calibration_data,
                "calibration_tokens": self.calibration_tokens, "options": self.refit.given(),
                **({"group_encoder": True} if self.group_encoder else {}),
                **({"kv_budget": str(self.kv_budget)} if self.kv_budget is not None else {}),
                **({"source_hub": dict(self.source_hub)} if self.source_hub else {})}

    @property
    def source_name(self) -> str:
        """How the source is named to others (model card, title): its Hub id (`org/name`, with
        `@revision` unless main) when it came from the Hub, else the folder or file name."""
        h = self.source_hub
        if h:
            return h["repo_id"] + (f"@{h['revision']}" if h.get("revision", "main") != "main" else "")
        return Path(self.source).name


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


def read_kv_plan(path: Path) -> tuple[int, ...]:
    """The `kv_heads` list of a plan file (`{"kv_heads": [...]}`, or a gqakit_convert.json whose
    settings or top level hold one), checked to be whole numbers of at least 1."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GqakitError(f"--kv-plan {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GqakitError(f"--kv-plan {path} is not a JSON file: {e}") from None
    heads = None
    if isinstance(data, dict):
        heads = data.get("kv_heads")
        if heads is None and isinstance(data.get("settings"), dict):
            heads = data["settings"].get("kv_heads")
    if not isinstance(heads, list) or not heads:
        raise GqakitError(f'--kv-plan {path} holds no "kv_heads" list (one KV head count per decoder layer)')
    bad = [h for h in heads if not isinstance(h, int) or isinstance(h, bool) or h < 1]
    if bad:
        raise GqakitError(f"--kv-plan {path}: each layer's KV heads must be a whole number of at least 1, "
                          f"got {bad[0]!r}")
    return tuple(heads)


def needs_data(method: str) -> bool:
    from gqakit.core.methods import METHODS

    return method in METHODS and METHODS[method].needs_data


