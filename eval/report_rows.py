"""The typed rows of `gqakit compare`'s report (report.json's `gqakit.compare/1` schema).

`report.build_report` makes a `Report` from the typed results blocks; report.json is its
`to_json()` and report.md is rendered from it, so the two never disagree. The models are
`records.Record`s: keys in field order, fields never set left out (`UNSET`), numbers kept as
they were made, and a registered measurement's entry in a row (keyed by its name) kept after
the built-in columns. `Report.from_json` reads a report.json back into the same types.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, StrictInt, StrictStr

from gqakit.eval.records import UNSET, AsGiven, MaxBatch, Num, Record

REPORT_SCHEMA = "gqakit.compare/1"


class GridPoint(Record):
    """A grid point's axes: batch, prompt length (an encoder-decoder's input length) and an
    encoder-decoder's output length."""

    batch: StrictInt
    prompt_len: StrictInt
    output_len: StrictInt = UNSET

    @classmethod
    def of(cls, key: tuple[int, ...]) -> "GridPoint":
        return cls(batch=key[0], prompt_len=key[1], **({"output_len": key[2]} if len(key) > 2 else {}))

    @property
    def axes(self) -> dict[str, int]:
        return {"batch": self.batch, "prompt_len": self.prompt_len,
                **({} if self.output_len is UNSET else {"output_len": self.output_len})}


class SpeedEntry(GridPoint):
    """One model's numbers at one grid point: tokens/s with its spread, and against the
    baseline's point the speedup, its interval, whether it is within noise, the prediction."""

    status: StrictStr
    tokens_per_s: Num = UNSET
    decode_ms_per_token: Num = UNSET
    prefill_ms: Num = UNSET
    roofline_fraction: Num = UNSET
    memory_bound: StrictBool = UNSET
    kv_cache_bytes: Num | None = UNSET
    peak_memory_bytes: Num | None = UNSET
    tokens_per_s_min: Num = UNSET
    tokens_per_s_max: Num = UNSET
    speedup: Num = UNSET
    speedup_interval: list[Num] | None = UNSET
    speedup_within_noise: StrictBool | None = UNSET
    predicted_speedup_bytes: Num = UNSET
    share_of_predicted: Num | None = UNSET
    share_of_predicted_within_noise: StrictBool = UNSET
    predicted_speedup_roofline: Num = UNSET
    share_of_predicted_roofline: Num | None = UNSET
    share_of_predicted_roofline_within_noise: StrictBool = UNSET

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class TaskEntry(Record):
    """One task metric of one model, and its difference from the baseline's (None: it has none)."""

    value: Num
    stderr: Num | None
    delta: Num | None


class ReportRow(Record):
    """One model of the report: what it is, then each measurement's columns."""

    name: StrictStr
    path: StrictStr
    method: StrictStr
    parameters: StrictInt
    heads: StrictInt
    kv_heads: StrictInt
    kv_bytes_per_token: Num
    dtype: StrictStr
    device: StrictStr
    conversion: AsGiven[dict[str, Any]] | None = UNSET  # gqakit's conversion record (null: none)
    encoder_kv_heads: StrictInt = UNSET           # encoder-decoders
    encoder_heads: StrictInt = UNSET
    cross_kv_bytes_per_token: Num | None = UNSET
    perplexity_objective: StrictStr = UNSET
    perplexity: Num = UNSET
    perplexity_delta_pct: Num | None = UNSET
    bits_per_byte: Num = UNSET
    word_perplexity: Num = UNSET
    speed: dict[str, SpeedEntry] = Field(default_factory=dict)  # by point label (b8_p1024)
    max_batch: dict[str, MaxBatch] = Field(default_factory=dict)  # by prompt length
    attention: StrictStr | None = None
    engine: StrictStr = UNSET                     # what ran the decode steps (absent: gqakit, before engines)
    tasks: dict[str, dict[str, TaskEntry]] = UNSET

    @property
    def encoder_decoder(self) -> bool:
        return self.encoder_kv_heads is not UNSET

    @property
    def objective(self) -> str:
        return "causal_lm" if self.perplexity_objective is UNSET else self.perplexity_objective


class MadeBy(Record):
    command: StrictStr
    gqakit: StrictStr
    date: StrictStr


class InputRow(Record):
    """Where one results file's numbers came from."""

    name: StrictStr
    command: StrictStr
    torch: StrictStr
    transformers: StrictStr
    gqakit: StrictStr
    git: StrictStr | None
    device: StrictStr
    dtype: StrictStr
    date: StrictStr


class TaskColumn(Record):
    task: StrictStr
    metric: StrictStr
    version: Any
    n_shot: StrictInt | None
    examples: StrictInt | None
    higher_is_better: StrictBool | None


class TasksHeader(Record):
    harness: dict[str, StrictStr]  # harness version per model
    columns: list[TaskColumn]


class Report(Record):
    """The whole report (report.json)."""

    schema_: StrictStr = Field(REPORT_SCHEMA, alias="schema")
    made_by: MadeBy
    inputs: list[InputRow]
    baseline: StrictStr
    grid: list[GridPoint]
    perplexity_settings: AsGiven[dict[str, Any]] | None
    tasks: TasksHeader | None
    rows: list[ReportRow]
    # the speed sections of all the models from one run with their steps alternating
    # (eval.speed.evaluate_speed_together), or each from its own run
    speed_timed_together: StrictBool
    warnings: list[StrictStr]
    perplexity_settings_by_objective: AsGiven[dict[str, Any]] = UNSET  # perplexities of several objectives
    train_log: StrictStr = UNSET
    plots: list[StrictStr] = UNSET

    @classmethod
    def of(cls, report: "Report | dict[str, Any]") -> "Report":
        """A report, or report.json's dict read back into one."""
        return report if isinstance(report, Report) else cls.model_validate(report)


__all__ = ["GridPoint", "InputRow", "MadeBy", "REPORT_SCHEMA", "Report", "ReportRow", "SpeedEntry", "TaskColumn",
           "TaskEntry", "TasksHeader"]
