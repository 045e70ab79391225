"""The typed blocks of `gqakit eval`'s results file (eval/results.py holds the file).

One JSON per evaluated model, split the way peft's method_comparison splits its results:
`run` (how and where the numbers were made), `model` (what was measured), then one block
per measurement (`perplexity`, `speed`, `tasks`: lm-evaluation-harness metrics with their
stderr, task versions and harness version; the block carries its own `format` number; and
the block of any other registered measurement).

One pydantic model per block, a `Record`: `RunInfo`, `ModelInfo`, `PerplexityResult`,
`SpeedResult` (its grid of `SpeedPoint`s and its `MaxBatch` rows) and `TasksResult`
(`TaskRow`s of `TaskMetric`s). runner, speed and tasks build them; report, plots and the
CLI summary read their attributes. The JSON keeps its exact bytes:

- keys are written in the order the fields are declared here (the order the writers always used);
- a field that was never set is `UNSET` and is left out (an out-of-memory grid point has no
  timings); `UNSET` is not null, and a null that was read is written back as null;
- numbers keep the type they were read or built with (`128` stays `128`, not `128.0`), and
  the small JSON objects the models do not unpack (`{"median": .., "p90": ..}`, the data's
  `path` and `sha256`) keep their own key order;
- keys this schema does not know (`extra`, from a newer or hand-edited file) are kept and
  written after the known ones, so a file read and written again is the same file.

A file is validated as it is read, so a damaged one (a perplexity that is a string, a
model that is null) is one `GqakitError` naming the file and the key, not a crash halfway
through a report. Unknown keys are allowed at every level: newer files stay readable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, WrapValidator,
                      model_validator)
from typing_extensions import Required, TypedDict


class Unset:
    """The type of `UNSET`: a key absent from the JSON (not the same as null)."""

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __copy__(self) -> "Unset":
        return self

    def __deepcopy__(self, memo: Any) -> "Unset":
        return self


UNSET: Any = Unset()


def opt(value: Any) -> Any:
    """The value, or None where the key was absent (UNSET)."""
    return None if value is UNSET else value


T = TypeVar("T")


def _as_given(value: Any, handler: Any) -> Any:
    handler(value)  # validated (or one error naming the key), then kept exactly as given
    return value


# A type checked as T, but the value kept as it was given: JSON numbers keep int or float,
# and small JSON objects keep their key order and their unknown keys.
AsGiven = Annotated[T, WrapValidator(_as_given)]
Num = AsGiven[StrictFloat]  # 5 and 5.0 pass (and stay as they are), "5", true and null do not


class _Open(TypedDict, total=False):
    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]


class Stat(_Open, total=False):
    """{"median": .., "p90": .., "min": .., "max": ..} of a timing over its repetitions (files
    written before `min` and `max` were recorded have only the median and p90)."""

    median: Required[Num]
    min: Num
    max: Num


class TextData(_Open, total=False):
    """Which text a perplexity was measured on (core.text.EvalText.describe, plus `seen_in_training`)."""

    path: Required[StrictStr]
    sha256: Required[StrictStr]


class TokenizerData(_Open, total=False):
    name_or_path: StrictStr
    vocab_size: StrictInt | None


class AttentionData(_Open, total=False):
    decode_path: StrictStr | None


class HarnessData(_Open, total=False):
    version: Required[StrictStr]


class Record(BaseModel):
    """A block of the results file: `to_json` / `from_json` by field order, unknown keys kept."""

    model_config = ConfigDict(extra="allow")

    @property
    def extra(self) -> dict[str, Any]:
        """Keys of the JSON this schema does not know, in their order."""
        return self.model_extra or {}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, f in type(self).model_fields.items():
            value = getattr(self, name)
            if value is not UNSET:
                out[f.alias or name] = _plain(value)
        out.update({k: _plain(v) for k, v in self.extra.items()})
        return out

    @classmethod
    def from_json(cls: type[T], data: dict[str, Any]) -> T:
        return cls.model_validate(data)  # type: ignore[attr-defined,no-any-return]


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------- run and model

class RunInfo(Record):
    """How and where the numbers were made: command, versions, device, date, commit."""

    command: StrictStr
    date: StrictStr
    gqakit: StrictStr
    git: StrictStr | None = UNSET
    torch: StrictStr
    transformers: StrictStr
    python: StrictStr = UNSET
    device: StrictStr = UNSET
    device_name: StrictStr
    dtype: StrictStr


class EncoderInfo(Record):
    """An encoder-decoder's encoder: its self-attention geometry."""

    layers: StrictInt
    heads: StrictInt
    kv_heads: StrictInt
    head_dim: StrictInt


class ConversionInfo(Record):
    """How gqakit made the measured model (its `gqakit_convert.json`): the method and G."""

    method: StrictStr
    num_kv_heads: StrictInt
    grouping: StrictStr = UNSET
    uptrained: StrictBool = UNSET  # the folder is `gqakit uptrain`'s export of a conversion


class HubInfo(Record):
    """Where a model given as a Hub id came from: its repository, the revision asked for, the snapshot's commit."""

    repo_id: StrictStr
    revision: StrictStr
    commit: StrictStr


class ModelInfo(Record):
    """Shape facts of the measured model, and the KV-cache bytes one token costs (in the run's dtype)."""

    path: StrictStr  # the model as given: a local path, or a Hub id (`org/name[@revision]`)
    hub: HubInfo = UNSET  # a Hub id's provenance (core/hub.py)
    model_type: StrictStr | None = UNSET
    parameters: StrictInt
    layers: StrictInt = UNSET
    heads: StrictInt
    kv_heads: StrictInt
    head_dim: StrictInt = UNSET
    max_positions: StrictInt | None = UNSET
    kv_bytes_per_token: Num
    # encoder-decoders: layers, heads, kv_heads and head_dim above are the decoder's (its
    # self- and cross-attention), kv_bytes_per_token its self-attention cache per output token
    encoder: EncoderInfo = UNSET
    cross_kv_bytes_per_token: Num = UNSET  # the cross-attention cache, per input token
    # how gqakit converted it; null: no conversion record (a model gqakit did not make)
    conversion: ConversionInfo | None = UNSET

    @property
    def name(self) -> str:
        return Path(self.path).name or self.path


# ----------------------------------------------------------------------------- perplexity

class SpanInfo(Record):
    """How held-out text was span-corrupted for an encoder-decoder's perplexity (core.spans)."""

    seed: StrictInt
    noise_density: Num
    mean_span_length: Num
    source_tokens: StrictInt     # text tokens per example, before corruption
    sentinels: StrictInt = UNSET  # sentinel tokens the tokenizer has


class PairFields(Record):
    """The JSONL fields of paired data."""

    input: StrictStr
    target: StrictStr


Objective = Literal["causal_lm", "span_corruption", "paired"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)


class PerplexityResult(Record):
    """Perplexity. `objective` says of what: absent (or "causal_lm"): every token of a document
    given the ones before it, over a sliding window; "span_corruption" / "paired": an
    encoder-decoder's target tokens given its input (held-out text with seeded spans, or
    input/target pairs), `context` then being the input length."""

    objective: Objective = UNSET
    context: StrictInt
    stride: StrictInt = UNSET    # causal_lm only
    step: StrictInt = UNSET      # tokens each window advances: min(stride, context - 1), see window_plan
    tokens: StrictInt            # tokens scored (document tokens, a leading BOS is context only; targets')
    examples: StrictInt = UNSET  # encoder-decoders: (input, target) pairs scored
    input_tokens: StrictInt = UNSET  # encoder-decoders: encoder tokens, all examples
    inputs_truncated: StrictInt = UNSET  # paired: inputs cut to `context` tokens
    windows: StrictInt = UNSET
    nll_sum: Num = UNSET         # total negative log-likelihood in nats
    words: StrictInt = UNSET
    bytes: StrictInt = UNSET
    token_perplexity: Num
    word_perplexity: Num = UNSET  # causal_lm and paired (of the targets' words)
    byte_perplexity: Num = UNSET
    bits_per_byte: Num = UNSET    # causal_lm and paired
    bos_prepended: StrictBool = UNSET
    tokenizer: AsGiven[TokenizerData]
    data: AsGiven[TextData]      # path, sha256, chars, max_chars, seen_in_training
    spans: SpanInfo = UNSET      # span_corruption
    fields: PairFields = UNSET   # paired

    @model_validator(mode="after")
    def _causal_complete(self) -> "PerplexityResult":
        if self.kind == "causal_lm":
            for k in ("stride", "word_perplexity", "bits_per_byte"):
                if getattr(self, k) is UNSET:
                    raise ValueError(f"causal_lm perplexity lacks {k}")
        return self

    @property
    def kind(self) -> str:
        """The objective; files without one are causal_lm."""
        return "causal_lm" if self.objective is UNSET else self.objective


# ----------------------------------------------------------------------------- speed

class SpeedPoint(Record):
    """One (batch, prompt length) decode measurement; status "oom" carries only a reason.

    For an encoder-decoder, `prompt_len` is the input (encoder) length and `output_len` the
    output tokens in the self-attention cache when the timed steps start; `encode_ms` is the
    encoder's time, part of `prefill_ms`.
    """

    batch: StrictInt
    prompt_len: StrictInt
    output_len: StrictInt = UNSET
    new_tokens: StrictInt = UNSET
    status: StrictStr
    reason: StrictStr = UNSET
    decode_mode: StrictStr = UNSET
    decode_path: dict[str, Any] = UNSET
    decode_samples: StrictInt = UNSET
    decode_sample: StrictStr = UNSET
    prefill_ms: AsGiven[Stat] | None = UNSET            # {"median", "p90", "min", "max"}
    prefill_samples: StrictInt = UNSET
    encode_ms: AsGiven[Stat] | None = UNSET             # {"median", "p90"}: the encoder, once per point
    decode_ms_per_token: AsGiven[Stat] | None = UNSET   # {"median", "p90", "min", "max"}
    tokens_per_s: AsGiven[Stat] | None = UNSET          # {"median", "p90_of_step_time", "min", "max"}
    warmup_s: Num = UNSET
    compile_s: Num | None = UNSET
    reps: StrictInt = UNSET
    packed_weight_bytes: StrictInt | None = UNSET
    peak_memory_bytes: Num | None = UNSET
    peak_memory_kind: StrictStr = UNSET
    kv_cache_bytes: Num | None = UNSET
    kv_cache_bytes_analytic: Num = UNSET
    bytes_per_step: AsGiven[dict[str, Num]] = UNSET      # {"weights", "kv", "total"}
    flops_per_step: Num = UNSET
    roofline_ms: AsGiven[dict[str, Num | None]] = UNSET  # {"bytes", "flops"}
    achieved_bandwidth_gbs: Num = UNSET
    roofline_fraction: Num | None = UNSET
    arithmetic_intensity: Num = UNSET
    memory_bound: StrictBool | None = UNSET
    engine: StrictStr = UNSET                            # what ran the steps (gqakit.engines); absent: gqakit
    engine_kv: AsGiven[dict[str, Any]] = UNSET           # the KV cache that engine allocated (engines.KvAllocation)

    @model_validator(mode="after")
    def _ok_has_numbers(self) -> "SpeedPoint":
        if self.status == "ok":
            for k in ("tokens_per_s", "decode_ms_per_token", "prefill_ms", "roofline_fraction", "memory_bound"):
                if opt(getattr(self, k)) is None:
                    raise ValueError(f"grid point with status ok lacks {k}")
        return self

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def key(self) -> tuple[int, ...]:
        """(batch, prompt length), and the output length for an encoder-decoder."""
        return (self.batch, self.prompt_len) if self.output_len is UNSET else (self.batch, self.prompt_len,
                                                                                self.output_len)


class MaxBatch(Record):
    """The largest batch that fits at one prompt length (`at_limit`: the search stopped at `limit`)."""

    prompt_len: StrictInt
    max_batch: StrictInt
    at_limit: StrictBool
    limit: StrictInt = UNSET
    method: StrictStr = ""


class SpeedResult(Record):
    """The decode benchmark: settings, device roofs, attention path, grid, max batch."""

    settings: dict[str, Any] = UNSET
    graph_error: StrictStr | None = UNSET
    attention: AsGiven[AttentionData] = Field(default_factory=dict)  # implementation, decode_path, ...
    device_roof: AsGiven[dict[str, Num]] = UNSET
    weight_bytes_per_step: StrictInt = UNSET
    kv_bytes_per_token: Num = UNSET
    kv_bytes_per_input_token: Num = UNSET   # encoder-decoders: the cross-attention cache of one input token
    grid: list[SpeedPoint] = Field(default_factory=list)
    max_batch: list[MaxBatch] = Field(default_factory=list)

    def points(self) -> dict[tuple[int, ...], SpeedPoint]:
        return {g.key: g for g in self.grid}

    @property
    def timed_with(self) -> list[str] | None:
        """The models whose decode steps alternated with this one's in one run
        (eval.speed.evaluate_speed_together); None: timed in its own run."""
        return self.settings.get("timed_with") if isinstance(self.settings, dict) else None


# ----------------------------------------------------------------------------- tasks

class TaskMetric(Record):
    value: Num
    stderr: Num | None = None
    higher_is_better: StrictBool | None = UNSET


class TaskRow(Record):
    """One task (or group) of lm-evaluation-harness: its metrics and how they were made."""

    version: Any = UNSET
    metrics: dict[str, TaskMetric]
    subtasks: list[StrictStr] = UNSET     # groups only
    n_shot: StrictInt | None = UNSET
    output_type: StrictStr | None = UNSET
    samples: dict[str, Any] = UNSET       # {"original", "effective"}
    dataset: dict[str, Any] = UNSET       # path, name, data_files [{path, sha256}]

    @property
    def examples(self) -> int | None:
        return (self.samples or {}).get("effective")

    @property
    def data_hashes(self) -> list[str | None]:
        return [f.get("sha256") for f in (self.dataset or {}).get("data_files", [])]


class TasksResult(Record):
    """The `tasks` block; `format` is its own version number (eval/tasks.py TASKS_FORMAT)."""

    format: StrictInt
    harness: AsGiven[HarnessData]         # name, package, version
    settings: dict[str, Any] = UNSET
    results: dict[str, TaskRow]
    groups: dict[str, TaskRow] = Field(default_factory=dict)

    @property
    def harness_version(self) -> str:
        return self.harness["version"]

    def rows(self) -> dict[str, TaskRow]:
        """Tasks, then groups."""
        return {**self.results, **self.groups}


__all__ = ["UNSET", "Unset", "opt", "Record", "RunInfo", "ModelInfo", "EncoderInfo", "ConversionInfo", "HubInfo",
           "PerplexityResult", "SpanInfo", "PairFields", "OBJECTIVES", "SpeedPoint", "MaxBatch", "SpeedResult",
           "TaskMetric", "TaskRow", "TasksResult"]
