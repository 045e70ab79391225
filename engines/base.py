"""The engine interface: what every serving engine gqakit measures offers.

An engine loads a model (a folder, a GGUF, or both: `formats`), generates greedily on token
ids, times one speed point, and reports the KV cache it allocated, in its own terms and as
bytes per token. `EngineOptions` is validated where it enters (the CLI, the API).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field

from gqakit.core.errors import GqakitError


class EngineMissing(GqakitError):
    """An engine whose package is not installed: the message says how to install it."""

    label = "engine not installed"


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


@dataclass
class PointTiming:
    prefill_s: list[float]      # seconds to process the batch's prompts, per repetition
    decode_s: list[float]       # seconds per decode step (one new token for every sequence), per sample


class EngineOptions(BaseModel):
    """How to load a model into an engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: str = "auto"          # weights/activations dtype name from core.units' table, or auto = the model's
    max_len: int = Field(2048, gt=0)   # longest sequence (prompt + new tokens) the engine must hold
    kv_budget_bytes: int | None = Field(None, gt=0)  # KV memory to give the engine; None: engine default
    threads: int | None = Field(None, gt=0)
    max_batch: int = Field(32, gt=0)   # most sequences at once
    gguf_file: str | None = None       # llama.cpp: which .gguf (a path, or a file name in a folder)


class Engine(Protocol):
    name: ClassVar[str]                 # "transformers" | "vllm" | "llama.cpp" | "gqakit"
    formats: ClassVar[tuple[str, ...]]  # what it loads: ("folder",), ("gguf",) or both

    def load(self, model: Path, options: EngineOptions) -> None: ...

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generation: ...

    def time_point(self, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int) -> PointTiming: ...

    def kv_allocation(self) -> KvAllocation: ...

    def close(self) -> None: ...
