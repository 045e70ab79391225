"""align-refit's options (`--refit-option KEY=VALUE`): `RefitOptions` as asked,
`ResolvedRefitOptions` with every "auto" that depends on the model decided, and the resolver
that decides them (`resolve_align_refit`, named by align-refit's entry in `core.methods`).

The `--help` section and docs/convert.md's tables are generated from here. Imports no torch.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, ValidationError,
                      model_validator)

from gqakit.core.errors import GqakitError

if TYPE_CHECKING:
    from gqakit.convert.resolved import Device
    from gqakit.convert.settings import ConvertSettings

SMALL_MODEL = 20_000_000  # parameters: below this, CPU calibration computes in float64

# What align-refit's "auto" settings resolve to (`resolve_align_refit`), from the
# measurements in docs/benchmarks.md ("Recommended conversion"). On SmolLM2-135M, 400
# one-sequence steps at lr 0.02 on q, k, v, o against the o_proj refit's target (the attention
# loss: better than the block loss's best, in half its time), then o_proj's closed form on the
# trained q, k, v (`final_o`; 56.1 against 60.4 for 400 two-sequence steps without it, in three
# quarters of the time), while with fewer calibration tokens, and so fewer
# steps, the block loss at lr 0.01 (the demo's 2,048 tokens and 12 steps: 741 against 1,215); on
# stories260K, 900 two-sequence steps at lr 0.024 on the whole block with similarity grouping
# (6.490, 6.302, 6.406 on seeds 0-2 against 6.489, 6.296, 6.416 for 2,000 one-sequence steps at lr
# 0.012, in about 60% of the time on two threads: a two-sequence step of so small a model costs
# about 1.3 one-sequence steps there).
MAX_SEQ_LEN = 512  # calibration sequences: the model's context, at most the context evaluated at
REFERENCE_TOKENS = 65536  # the steps below are for this many calibration tokens; fewer in proportion
BEST = {"small": {"steps": 900, "lr": 0.024, "train": "block", "loss": "block", "grouping": "similarity",
                  "cpu_tokens": 1024, "block_lr": 0.024},
        "large": {"steps": 400, "lr": 0.02, "train": "attention", "loss": "attention", "grouping": "contiguous",
                  "cpu_tokens": 512, "block_lr": 0.01}}  # block_lr: lr with the block loss

Number = StrictInt | StrictFloat  # an int stays an int, so the record shows what was asked


class RefitOptions(BaseModel):
    """The settings of a calibrated conversion (`--refit-option KEY=VALUE`), with their defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    seq_len: Literal["auto"] | Annotated[StrictInt, Field(ge=2)] = Field(
        "auto", description=f"tokens per calibration sequence (auto: the model's context, at most {MAX_SEQ_LEN})")
    batch: Literal["auto"] | Annotated[StrictInt, Field(ge=1)] = Field(
        "auto", description="sequences per block forward and per reconstruction step (auto: 4 on the CPU, 8 on a "
                            f"GPU, at most 2,048 tokens on a GPU and {BEST['large']['cpu_tokens']:,} on the CPU, "
                            f"{BEST['small']['cpu_tokens']:,} for a model under {SMALL_MODEL // 10**6}M parameters)")
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
    dtype: Literal["auto", "float32", "float64", "bfloat16"] = Field(
        "auto", description="compute dtype of the block passes (the fits' rows, the streams' advance): "
                            "float32, float64 or bfloat16 (autocast); auto: float64 under "
                            f"{SMALL_MODEL // 10**6}M parameters on the CPU, else bfloat16 where native, else float32")
    step_dtype: Literal["auto", "float32", "float64", "bfloat16"] = Field(
        "auto", description="compute dtype of the reconstruction steps (bfloat16: autocast over float32 weights "
                            f"and streams; auto: float32 for a model under {SMALL_MODEL // 10**6}M parameters, else "
                            "bfloat16 where the device multiplies it natively, else float32)")
    stream_dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = Field(
        "auto", description="storage dtype of the two hidden-state streams: auto (the passes' output dtype: "
                            "float32 for bfloat16 passes), float32, "
                            "float64, bfloat16 or float16")
    offload: Literal["auto", "device", "cpu", "disk"] = Field(
        "auto", description="where the streams live: device, cpu (host memory), disk (files beside OUT) or auto "
                            "(the device when they fit, else host memory, else disk)")
    save_seconds: Number = Field(
        120.0, ge=0, description="how often, at most, the resume state (the streams and the finished layers) is "
                                 "saved, so that a killed run resumes")
    steps: Literal["auto"] | Annotated[StrictInt, Field(ge=0)] = Field(
        "auto", description=f"block-wise reconstruction: Adam steps per layer (0: closed-form fits only; auto: "
                                  f"{BEST['large']['steps']}, or {BEST['small']['steps']} for a model under "
                                  f"{SMALL_MODEL // 10**6}M parameters, fewer in proportion below "
                                  f"{REFERENCE_TOKENS:,} calibration tokens; 0 with --effort fast)")
    lr: Literal["auto"] | Annotated[Number, Field(gt=0)] = Field(
        "auto", description=f"the steps' learning rate, relative to each tensor's RMS (decaying linearly to 0; "
                                  f"auto: {BEST['large']['lr']}, {BEST['large']['block_lr']} with the block loss, "
                                  f"or {BEST['small']['lr']} for a model under {SMALL_MODEL // 10**6}M parameters)")
    guard_spans: StrictInt = Field(8, ge=1, description="batches of sequences the guard measures on (it keeps the "
                                                        "closed-form fit when the steps do not help)")
    guard_checks: StrictInt = Field(4, ge=1, description="guard evaluations over a layer's steps, evenly spaced "
                                                         "(the last after the final step)")
    patience: StrictInt = Field(0, ge=0, description="stop a layer's steps once this many guard evaluations in a "
                                                     "row have not improved its loss (0: take every step)")
    loss: Literal["auto", "block", "attention"] = Field(
        "auto", description="what the reconstruction steps minimise: the relative error of the block's output "
                            "(block) or the o_proj refit's weighted error of the residual stream after the "
                            "attention (attention: a step runs neither the MLP nor its backward, at about half "
                            f"the time; not with train=block); auto: {BEST['large']['loss']} for a model of "
                            f"{SMALL_MODEL // 10**6}M parameters or more with {REFERENCE_TOKENS:,} calibration "
                            f"tokens or more, else {BEST['small']['loss']}")
    final_o: StrictBool = Field(
        True, description="attention loss: refit o_proj after the steps, kept where the guard prefers it")
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
            parsed = cls(**options)
        except ValidationError as e:
            key = str(e.errors()[0]["loc"][0])
            raise GqakitError(_option_error(key, options[key])) from None
        if parsed.loss == "attention" and parsed.train == "block":
            raise GqakitError("align-refit option loss=attention trains q, k, v and o only: it does not go with "
                              "train=block")
        return parsed

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

    @property
    def refits_o_after_steps(self) -> bool:
        """Whether a layer's steps end with o_proj's closed form on the trained q, k, v (`final_o`, the
        attention loss, the o_proj refit on): one more pass over the spans."""
        return self.final_o and self.loss == "attention" and float(self.o_ridge) >= 0

    def trains_block(self, kv_from: int | None = None, kv_to: int | None = None) -> bool:
        """Whether the steps train every weight of each converted block (`train=block` with steps),
        so that the writer takes the blocks' MLP and norms from the calibration stage."""
        return self.train_steps(kv_from, kv_to) > 0 and self.train == "block"


def _option_error(key: str, value: Any) -> str:
    """The one line for a refused align-refit option, from the field's type and limits."""
    field = RefitOptions.model_fields[key]
    kinds = _base_types(field.annotation)
    limits = _limits([*field.metadata, *_inner_metadata(field.annotation)])
    auto = " or auto" if "auto" in _choices(field) else ""
    if float in kinds:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"align-refit option {key} must be a finite number{auto}, got {value!r}"
        if "ge" in limits and "lt" in limits:
            return f"align-refit option {key} must be in [{limits['ge']}, {limits['lt']}), got {value!r}"
        op = ">" if "gt" in limits else ">="
        return f"align-refit option {key} must be {op} {limits.get('gt', limits.get('ge'))}{auto}, got {value!r}"
    if bool in kinds:
        return f"align-refit option {key} must be true or false, got {value!r}"
    if int in kinds:
        return f"align-refit option {key} must be an integer >= {limits['ge']}{auto}, got {value!r}"
    return f"align-refit option {key}={value!r}; choose from {', '.join(_choices(field))}"


def _limits(metadata: Iterable[Any]) -> dict[str, Any]:
    """The numeric limits (gt, ge, lt) among a field's constraints."""
    return {name: getattr(m, name) for m in metadata for name in ("gt", "ge", "lt")
            if getattr(m, name, None) is not None}


def _inner_metadata(annotation: Any) -> list[Any]:
    """The constraints inside an annotation (an `Annotated[int, Field(ge=1)]` within a union)."""
    out: list[Any] = []
    for a in get_args(annotation):
        if hasattr(a, "metadata"):  # a FieldInfo of an Annotated member
            out += list(a.metadata)
        elif not isinstance(a, str):
            out += _inner_metadata(a)
    return out


def _base_types(annotation: Any) -> set[Any]:
    """The plain types inside an annotation (through unions and Annotated)."""
    args = get_args(annotation)
    if not args:
        return {annotation}
    return set().union(*(_base_types(a) for a in args if not isinstance(a, str)))


def _choices(field: Any) -> list[str]:
    """The strings a Literal field (or a Literal inside a union) accepts."""
    return [c for a in (field.annotation, *get_args(field.annotation)) for c in get_args(a) if isinstance(c, str)]


class ResolvedRefitOptions(RefitOptions):
    """align-refit's options for one model on one device: what every "auto" meant for its size,
    context, output kind and the device's memory, decided (`resolve_align_refit`)."""

    seq_len: StrictInt = Field(ge=2, description=RefitOptions.model_fields["seq_len"].description)
    batch: StrictInt = Field(ge=1, description=RefitOptions.model_fields["batch"].description)
    steps: StrictInt = Field(ge=0, description=RefitOptions.model_fields["steps"].description)
    lr: Number = Field(gt=0, description=RefitOptions.model_fields["lr"].description)
    train: Literal["attention", "block"] = Field(description=RefitOptions.model_fields["train"].description)
    loss: Literal["block", "attention"] = Field(description=RefitOptions.model_fields["loss"].description)
    dtype: Literal["float32", "float64", "bfloat16"] = Field(description=RefitOptions.model_fields["dtype"].description)
    step_dtype: Literal["float32", "float64", "bfloat16"] = Field(
        description=RefitOptions.model_fields["step_dtype"].description)
    stream_dtype: Literal["float32", "float64", "bfloat16", "float16"] = Field(
        description=RefitOptions.model_fields["stream_dtype"].description)
    offload: Literal["device", "cpu", "disk"] = Field(description=RefitOptions.model_fields["offload"].description)

    @property
    def weights_dtype(self) -> str:
        return held_dtype(self.dtype)


def held_dtype(dtype: str) -> str:
    """The dtype the blocks' weights and the passes' outputs are held in, for passes computed in
    `dtype` (bfloat16 passes are autocast over float32)."""
    return "float32" if dtype == "bfloat16" else dtype


ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def auto_batch(seq_len: int, gpu: bool, cpu_tokens: int = 1024) -> int:
    """Sequences per block forward: 4 on the CPU, 8 on a GPU, at most `cpu_tokens` and 2,048 tokens
    (enough to keep it busy, while the float64 temporaries of the fits stay small next to the
    streams; each reconstruction step sees one such batch, so on the CPU, where a step's time
    grows with its tokens, fewer tokens buy more steps in the same time; for a model as small
    as stories260K a two-sequence step costs about 1.3 one-sequence steps on two threads, hence
    its larger `cpu_tokens`)."""
    return max(1, min(8 if gpu else 4, (2048 if gpu else cpu_tokens) // seq_len))


def auto_offload(stream_bytes: int, block_bytes: int, device: Device) -> tuple[str, str]:
    """Where the streams go, and why: the device when they fit next to a few blocks, else host
    memory, else disk."""
    gib = lambda b: f"{b / 2**30:,.2f} GiB"  # noqa: E731
    if device.gpu and stream_bytes < 0.7 * (device.free - 4 * block_bytes):
        return "device", f"auto: device ({gib(stream_bytes)} of streams, {gib(device.free)} free on {device.name})"
    if stream_bytes < 0.5 * device.host_free:
        return "cpu", f"auto: cpu ({gib(stream_bytes)} of streams, {gib(device.host_free)} of host memory free)"
    return "disk", (f"auto: disk ({gib(stream_bytes)} of streams, over half the {gib(device.host_free)} of "
                    "host memory free)")


def resolve_align_refit(settings: ConvertSettings, *, source_params: int, max_positions: int | None,
                        output: str, device: Device | None = None, hidden: int | None = None,
                        layers: int | None = None) -> tuple[str, ResolvedRefitOptions, dict[str, str]]:
    """align-refit's "auto" settings decided from the model's parameters, context, width and
    depth, the output kind and the device (its kind and free memory): (grouping, options, the
    reason for each value "auto" chose). Explicit values are kept as given."""
    reasons: dict[str, str] = {}
    grouping, refit = settings.grouping, settings.refit
    small = source_params < SMALL_MODEL
    count = f"{source_params / 1e6:,.0f}M" if source_params >= 10**7 else f"{source_params:,}"
    size = f"{count} parameters, {'under' if small else 'at least'} 20M"
    best = BEST["small" if small else "large"]
    r: dict[str, Any] = {}
    if grouping == "auto":
        grouping = str(best["grouping"])
        reasons["grouping"] = f"auto: {grouping} ({size})"
    if refit.seq_len == "auto":
        r["seq_len"] = min(MAX_SEQ_LEN, max_positions or MAX_SEQ_LEN)
        reasons["seq_len"] = (f"auto: {r['seq_len']} (the model's context {max_positions}, at most "
                              f"{MAX_SEQ_LEN})" if max_positions else f"auto: {r['seq_len']}")
    if refit.steps == "auto":
        if settings.effort == "fast":
            r["steps"] = 0
            reasons["steps"] = "auto: 0 (--effort fast: the closed-form fits only)"
        else:
            share = min(1.0, settings.calibration_tokens / REFERENCE_TOKENS)
            r["steps"] = max(1, round(best["steps"] * share))
            reasons["steps"] = f"auto: {r['steps']} (--effort best, {size}" + (
                f"; {best['steps']} scaled to {settings.calibration_tokens:,} of {REFERENCE_TOKENS:,} "
                "calibration tokens)" if share < 1 else ")")
    if refit.train == "auto":
        gguf = output == "gguf"
        r["train"] = "attention" if gguf or refit.loss == "attention" else best["train"]
        reasons["train"] = f"auto: {r['train']} (" + ("a .gguf OUT keeps the other tensors' bytes)" if gguf else
                                                      "loss=attention)" if refit.loss == "attention" else f"{size})")
    if refit.loss == "auto":
        train = r.get("train", refit.train)
        few = settings.calibration_tokens < REFERENCE_TOKENS and best["loss"] != "block"
        r["loss"] = "block" if train == "block" or few else best["loss"]
        reasons["loss"] = f"auto: {r['loss']} (" + (
            "train=block)" if train == "block" else
            f"{size}; fewer than {REFERENCE_TOKENS:,} calibration tokens, so fewer steps)" if few else f"{size})")
    loss = r.get("loss", refit.loss)
    if refit.lr == "auto":
        r["lr"] = best["block_lr"] if loss == "block" else best["lr"]
        reasons["lr"] = f"auto: {r['lr']} ({size}, {loss} loss)"
    measured = device is not None
    if device is None:  # the CPU, nothing measured
        from gqakit.convert.resolved import Device

        device = Device("cpu", 0, 0, False)
        hidden = None  # where the streams go needs the free memory
    seq_len = int(r.get("seq_len", refit.seq_len))
    seq_len = min(seq_len, max_positions) if max_positions else seq_len
    if refit.batch == "auto":
        r["batch"] = auto_batch(seq_len, device.gpu, int(best["cpu_tokens"]))
        reasons["batch"] = f"auto: {r['batch']} ({seq_len}-token sequences on {'a GPU' if device.gpu else 'the CPU'}" + (
            ")" if device.gpu else f", at most {best['cpu_tokens']:,} tokens for {size})")
    if refit.dtype == "auto":
        r["dtype"] = ("float64" if not device.gpu else "float32") if small else (
            "bfloat16" if device.bf16 else "float32")
        native = (f"; {device.name} multiplies bfloat16 natively" if device.bf16 else
                  f"; {device.name} has no native bfloat16") if not small else ""
        reasons["dtype"] = f"auto: {r['dtype']} ({size}, on {device.name}{native})"
    dtype = held_dtype(str(r.get("dtype", refit.dtype)))
    if refit.step_dtype == "auto":
        if small:  # float64 buys the steps nothing over float32 (the fits before them stay in float64)
            r["step_dtype"] = "float32"
            reasons["step_dtype"] = f"auto: float32 ({size})"
        elif device.bf16:
            r["step_dtype"] = "bfloat16"
            reasons["step_dtype"] = f"auto: bfloat16 ({size}; {device.name} multiplies bfloat16 natively)"
        else:
            r["step_dtype"] = "float32"
            reasons["step_dtype"] = f"auto: float32 ({size}; {device.name} has no native bfloat16)"
    if measured and not device.bf16:  # bfloat16 asked for where it is emulated: say what it costs
        for key in ("dtype", "step_dtype"):
            if getattr(refit, key) == "bfloat16":
                reasons[key] = (f"bfloat16 as asked; {device.name} has no native bfloat16, where its matrix "
                                "products are many times slower than float32's")
    if refit.stream_dtype == "auto":
        r["stream_dtype"] = dtype
        reasons["stream_dtype"] = f"auto: {dtype} (the passes' output dtype)"
    if refit.offload == "auto":
        if hidden is None:
            r["offload"] = "cpu"
            reasons["offload"] = "auto: cpu (host memory; the streams' size or the free memory unknown)"
        else:
            n_tokens = math.ceil(settings.calibration_tokens / seq_len) * seq_len
            # the two streams, and the attention loss's targets while a layer's steps last
            n_streams = 3 if loss == "attention" else 2
            stream_bytes = n_streams * n_tokens * hidden * ITEMSIZE[str(r.get("stream_dtype", refit.stream_dtype))]
            block_bytes = source_params // max(layers or 1, 1) * ITEMSIZE[dtype]
            r["offload"], reasons["offload"] = auto_offload(stream_bytes, block_bytes, device)
    # the fields not given keep their defaults, as in `refit`
    resolved = ResolvedRefitOptions(**{**{k: getattr(refit, k) for k in refit.model_fields_set}, **r})
    resolved._given = refit._given
    return grouping, resolved, reasons


def refit_options_markdown() -> str:
    """The README's table of align-refit options (`tests/test_convert_settings.py` keeps them equal)."""
    rows = ["| option | default | what |", "|---|---|---|"]
    for key, f in RefitOptions.model_fields.items():
        rows.append(f"| `{key}` | `{f.default}` | {f.description.replace('|', '&#124;')} |")
    return "\n".join(rows)


def auto_settings_markdown() -> str:
    """The README's table of what align-refit's "auto" settings resolve to (`resolve_align_refit`;
    `tests/test_convert_settings.py` keeps them equal)."""
    rows = ["| model | `--grouping` | `seq_len` | `batch` on the CPU | `steps` at 65,536 tokens | `lr` | `train` "
            "| `loss` |", "|---|---|---|---|---|---|---|---|"]
    for key, what in (("small", "under 20M parameters"), ("large", "20M parameters or more")):
        b = BEST[key]
        lr = f"{b['lr']}" + (f" ({b['block_lr']} with the block loss)" if b["block_lr"] != b["lr"] else "")
        loss = f"{b['loss']}" + (f" (block below {REFERENCE_TOKENS:,} tokens)" if b["loss"] != "block" else "")
        rows.append(f"| {what} | {b['grouping']} | the model's context, at most {MAX_SEQ_LEN} | at most "
                    f"{b['cpu_tokens']:,} tokens | {b['steps']:,} | {lr} | {b['train']} | {loss} |")
    return "\n".join(rows)


def refit_options_help() -> str:
    """The `--help` section listing every align-refit option with its default."""
    lines = ["\b", "align-refit options (--refit-option KEY=VALUE, repeatable; KEY=default: what):"]
    for key, f in RefitOptions.model_fields.items():
        lines += textwrap.wrap(f"{key}={f.default}: {f.description}", width=78, initial_indent="  ",
                               subsequent_indent="      ", break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines)

