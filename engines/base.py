"""The engine protocol: what `gqakit eval --speed` and `--check` need of any engine that runs a
model (gqakit's own runtime, stock transformers, vLLM, llama.cpp).

An `Engine` loads a model folder or GGUF (`formats`), generates greedily from token ids,
times a grid point (`time_point`: prefill per repetition, seconds per decode step), and
reports the KV cache it allocated itself (`kv_allocation`). Nothing here imports torch or an
engine: each engine imports its own library in `load`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, field_validator

from gqakit.core.errors import GqakitError
from gqakit.core.units import DTYPES, dtype_named


class EngineMissing(GqakitError):
    """An engine whose library is not installed: one line saying how to install it (exit 2)."""


@dataclass
class Generation:
    tokens: list[list[int]]                    # greedy ids generated per prompt (prompt excluded)
    logprobs: list[list[float]] | None = None  # the engine's logprob of each generated token, when it gives them
    seconds: float = 0.0                       # wall time of the whole call


@dataclass
class KvAllocation:
    bytes_per_token: int        # KV-cache bytes the engine allocates per cached token, all layers together
    capacity_tokens: int        # tokens the engine's allocated cache holds
    total_bytes: int            # bytes the engine allocated for the KV cache
    detail: dict[str, Any] = field(default_factory=dict)   # engine's own terms: block size, blocks, cache dtype, ...

    def record(self) -> dict[str, Any]:
        """As a results file keeps it."""
        return {"bytes_per_token": self.bytes_per_token, "capacity_tokens": self.capacity_tokens,
                "total_bytes": self.total_bytes, "detail": dict(self.detail)}


@dataclass
class PointTiming:
    prefill_s: list[float]      # seconds to process the batch's prompts, per repetition
    decode_s: list[float]       # seconds per decode step (one new token for every sequence), per sample


class EngineOptions(BaseModel):
    """How an engine is loaded; validated where it enters (the CLI, the Python API, a test)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: str = "auto"           # weights/activations dtype name from core.units' table, or auto = the model's
    max_len: int = 2048           # longest sequence (prompt + new tokens) the engine must hold
    kv_budget_bytes: int | None = None   # KV memory to give the engine; None: the engine's default
    threads: int | None = None
    max_batch: int = 32           # most sequences at once
    gguf_file: str | None = None  # llama.cpp: which .gguf (a path, or a file name in a folder)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v == "auto":
            return v
        d = dtype_named(v)
        if d is None:
            raise GqakitError(f"engine dtype must be auto or one of {', '.join(DTYPES)}; got {v!r}")
        return d.name

    @field_validator("max_len", "max_batch")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise GqakitError(f"engine max_len and max_batch must be at least 1, got {v}")
        return v

    @field_validator("kv_budget_bytes", "threads")
    @classmethod
    def _positive_or_none(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise GqakitError(f"engine kv_budget_bytes and threads must be at least 1 when given, got {v}")
        return v


@runtime_checkable
class Engine(Protocol):
    name: ClassVar[str]                 # "transformers" | "vllm" | "llama.cpp" | "gqakit"
    formats: ClassVar[tuple[str, ...]]  # what it loads: ("folder",), ("gguf",) or both

    def load(self, model: Path, options: EngineOptions) -> None: ...

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generation: ...   # greedy, ids in and out

    def time_point(self, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int) -> PointTiming: ...

    def kv_allocation(self) -> KvAllocation: ...

    def close(self) -> None: ...

    # Optional: `step_bytes() -> (weight bytes one decode step reads, KV bytes per cached token)`
    # in the engine's own storage, for an engine that keeps the model in other types than the
    # compute dtype (llama.cpp); without it the speed prediction uses the model's geometry.


__all__ = ["Engine", "EngineMissing", "EngineOptions", "Generation", "KvAllocation", "PointTiming"]
