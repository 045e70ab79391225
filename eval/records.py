"""Typed eval results: what `gqakit eval` measures, and what `compare` and the plots read.

One dataclass per block of the results file (schema `gqakit.eval/1`, see results.py):
`EvalResult` holds `RunInfo`, `ModelInfo`, `PerplexityResult`, `SpeedResult` (its grid of
`SpeedPoint`s and its `MaxBatch` rows) and `TasksResult` (`TaskRow`s of `TaskMetric`s).
runner, speed and tasks build them; report, plots and the CLI summary read their
attributes. The JSON is unchanged: `to_json` writes the keys in the order the fields are
declared here (the order the writers always used), leaves out fields that were never
set (`UNSET`: an out-of-memory grid point has no timings), and appends keys this module
does not know (`extra`, from a newer or hand-edited file) so a file read and written
again is the same file. `EvalResult.from_json` validates with results.py's pydantic
models first, so a damaged file is a one-line error, not a crash mid-report.

Leaf statistics (`{"median": .., "p90": ..}`), settings and provenance sub-blocks stay
plain JSON values: they are printed, never computed with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


class _Unset:
    """A key absent from the JSON (not the same as null)."""

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()


def opt(value: Any) -> Any:
    """The value, or None where the key was absent (UNSET)."""
    return None if value is UNSET else value


class Record:
    """to_json / from_json by field order; nested records named in `_nested`."""

    # field name -> (record class, "one" | "list" | "dict")
    _nested: ClassVar[dict[str, tuple[type, str]]] = {}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            if v is UNSET:
                continue
            kind = self._nested.get(f.name, (None, ""))[1]
            if v is None or not kind:
                out[f.name] = v
            elif kind == "one":
                out[f.name] = v.to_json()
            elif kind == "list":
                out[f.name] = [x.to_json() for x in v]
            else:
                out[f.name] = {k: x.to_json() for k, x in v.items()}
        out.update(getattr(self, "extra", {}))
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kw: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in data.items():
            if k not in names or k == "extra":
                extra[k] = v
                continue
            sub, kind = cls._nested.get(k, (None, ""))
            if v is None or not kind:
                kw[k] = v
            elif kind == "one":
                kw[k] = sub.from_json(v)
            elif kind == "list":
                kw[k] = [sub.from_json(x) for x in v]
            else:
                kw[k] = {n: sub.from_json(x) for n, x in v.items()}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in kw and f.name != "extra" and f.default is dataclasses.MISSING \
                    and f.default_factory is dataclasses.MISSING:
                kw[f.name] = UNSET
        if "extra" in names:
            kw["extra"] = extra
        return cls(**kw)


# ----------------------------------------------------------------------------- run and model

@dataclass(kw_only=True)
class RunInfo(Record):
    """How and where the numbers were made: command, versions, device, date, commit."""

    command: str
    date: str
    gqakit: str
    git: str | None = UNSET
    torch: str
    transformers: str
    python: str = UNSET
    device: str = UNSET
    device_name: str
    dtype: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class ModelInfo(Record):
    """Shape facts of the measured model, and the KV-cache bytes one token costs."""

    path: str
    model_type: str | None = UNSET
    parameters: int
    layers: int = UNSET
    heads: int
    kv_heads: int
    head_dim: int = UNSET
    max_positions: int | None = UNSET
    kv_bytes_per_token: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return Path(self.path).name or self.path


# ----------------------------------------------------------------------------- perplexity

@dataclass(kw_only=True)
class PerplexityResult(Record):
    context: int
    stride: int
    step: int = UNSET       # tokens each window advances: min(stride, context - 1), see window_plan
    tokens: int             # tokens scored (document tokens; the leading BOS is context only)
    windows: int = UNSET
    nll_sum: float = UNSET  # total negative log-likelihood in nats
    words: int = UNSET
    bytes: int = UNSET
    token_perplexity: float
    word_perplexity: float
    byte_perplexity: float = UNSET
    bits_per_byte: float
    bos_prepended: bool = UNSET
    tokenizer: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)  # path, sha256, chars, seen_in_training ...
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- speed

@dataclass(kw_only=True)
class SpeedPoint(Record):
    """One (batch, prompt length) decode measurement; status "oom" carries only a reason."""

    batch: int
    prompt_len: int
    new_tokens: int = UNSET
    status: str
    reason: str = UNSET
    decode_mode: str = UNSET
    decode_path: dict[str, Any] = UNSET
    decode_samples: int = UNSET
    decode_sample: str = UNSET
    prefill_ms: dict[str, float] = UNSET            # {"median", "p90"}
    prefill_samples: int = UNSET
    decode_ms_per_token: dict[str, float] = UNSET   # {"median", "p90"}
    tokens_per_s: dict[str, float] = UNSET          # {"median", "p90_of_step_time"}
    warmup_s: float = UNSET
    compile_s: float | None = UNSET
    reps: int = UNSET
    packed_weight_bytes: int | None = UNSET
    peak_memory_bytes: float | None = UNSET
    peak_memory_kind: str = UNSET
    kv_cache_bytes: float | None = UNSET
    kv_cache_bytes_analytic: float = UNSET
    bytes_per_step: dict[str, float] = UNSET        # {"weights", "kv", "total"}
    flops_per_step: float = UNSET
    roofline_ms: dict[str, float | None] = UNSET    # {"bytes", "flops"}
    achieved_bandwidth_gbs: float = UNSET
    roofline_fraction: float = UNSET
    arithmetic_intensity: float = UNSET
    memory_bound: bool = UNSET
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def key(self) -> tuple[int, int]:
        return self.batch, self.prompt_len


@dataclass(kw_only=True)
class MaxBatch(Record):
    """The largest batch that fits at one prompt length (`at_limit`: the search stopped at `limit`)."""

    prompt_len: int
    max_batch: int
    at_limit: bool
    limit: int = UNSET
    method: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class SpeedResult(Record):
    """The decode benchmark: settings, device roofs, attention path, grid, max batch."""

    _nested: ClassVar[dict[str, tuple[type, str]]] = {"grid": (SpeedPoint, "list"), "max_batch": (MaxBatch, "list")}
    settings: dict[str, Any] = UNSET
    graph_error: str | None = UNSET
    attention: dict[str, Any] = field(default_factory=dict)  # implementation, decode_path, ...
    device_roof: dict[str, float] = UNSET
    weight_bytes_per_step: int = UNSET
    kv_bytes_per_token: float = UNSET
    grid: list[SpeedPoint] = field(default_factory=list)
    max_batch: list[MaxBatch] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def points(self) -> dict[tuple[int, int], SpeedPoint]:
        return {g.key: g for g in self.grid}


# ----------------------------------------------------------------------------- tasks

@dataclass(kw_only=True)
class TaskMetric(Record):
    value: float
    stderr: float | None = None
    higher_is_better: bool | None = UNSET
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class TaskRow(Record):
    """One task (or group) of lm-evaluation-harness: its metrics and how they were made."""

    _nested: ClassVar[dict[str, tuple[type, str]]] = {"metrics": (TaskMetric, "dict")}
    version: Any = UNSET
    metrics: dict[str, TaskMetric]
    subtasks: list[str] = UNSET          # groups only
    n_shot: int | None = UNSET
    output_type: str | None = UNSET
    samples: dict[str, Any] = UNSET      # {"original", "effective"}
    dataset: dict[str, Any] = UNSET      # path, name, data_files [{path, sha256}]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def examples(self) -> int | None:
        return (self.samples or {}).get("effective")

    @property
    def data_hashes(self) -> list[str | None]:
        return [f.get("sha256") for f in (self.dataset or {}).get("data_files", [])]


@dataclass(kw_only=True)
class TasksResult(Record):
    """The `tasks` block; `format` is its own version number (eval/tasks.py TASKS_FORMAT)."""

    _nested: ClassVar[dict[str, tuple[type, str]]] = {"results": (TaskRow, "dict"), "groups": (TaskRow, "dict")}
    format: int
    harness: dict[str, Any]              # name, package, version
    settings: dict[str, Any] = UNSET
    results: dict[str, TaskRow]
    groups: dict[str, TaskRow] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def harness_version(self) -> str:
        return self.harness["version"]

    def rows(self) -> dict[str, TaskRow]:
        """Tasks, then groups."""
        return {**self.results, **self.groups}


# ----------------------------------------------------------------------------- the whole file

@dataclass(kw_only=True)
class EvalResult(Record):
    """One results file: one model, measured once."""

    _nested: ClassVar[dict[str, tuple[type, str]]] = {
        "run": (RunInfo, "one"), "model": (ModelInfo, "one"), "perplexity": (PerplexityResult, "one"),
        "speed": (SpeedResult, "one"), "tasks": (TasksResult, "one")}
    schema: str
    run: RunInfo
    model: ModelInfo
    perplexity: PerplexityResult | None = UNSET
    speed: SpeedResult | None = UNSET
    tasks: TasksResult | None = UNSET
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str | Path = "<results>") -> "EvalResult":
        """Validated (results.check_results: one GqakitError naming the key) before it is built."""
        from gqakit.eval.results import check_results

        check_results(data, Path(path))
        return super().from_json(data)


__all__ = ["UNSET", "opt", "Record", "RunInfo", "ModelInfo", "PerplexityResult", "SpeedPoint", "MaxBatch", "SpeedResult",
           "TaskMetric", "TaskRow", "TasksResult", "EvalResult"]
