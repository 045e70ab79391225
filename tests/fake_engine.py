"""Fake engines for the engine tests: fixed timings and a fixed KV allocation (FakeEngine), a
corrupted greedy token (CorruptEngine, around the real transformers engine), and a module
whose library is missing (`missing_engine`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from gqakit.engines.base import EngineOptions, Generation, KvAllocation, PointTiming
from gqakit.engines.hf import TransformersEngine

PREFILL_S = 0.010      # seconds per prefill, every repetition
DECODE_S = 0.002       # seconds per decode step, every sample
KV_PER_TOKEN = 1234    # bytes per token the fake says it allocated
CAPACITY = 4096


class FakeEngine:
    name: ClassVar[str] = "fake"
    formats: ClassVar[tuple[str, ...]] = ("folder",)
    calls: ClassVar[list[tuple[Any, ...]]] = []

    def load(self, model: Path, options: EngineOptions) -> None:
        self.options = options
        FakeEngine.calls.append(("load", str(model), options.max_len, options.max_batch))

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generation:
        return Generation(tokens=[[0] * max_new_tokens for _ in prompts])

    def time_point(self, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int) -> PointTiming:
        FakeEngine.calls.append(("time_point", batch, prompt_len, new_tokens, reps, warmup))
        return PointTiming(prefill_s=[PREFILL_S] * reps, decode_s=[DECODE_S] * (new_tokens * reps))

    def kv_allocation(self) -> KvAllocation:
        return KvAllocation(bytes_per_token=KV_PER_TOKEN, capacity_tokens=CAPACITY,
                            total_bytes=KV_PER_TOKEN * CAPACITY, detail={"block_size": 16})

    def close(self) -> None:
        FakeEngine.calls.append(("close",))


class CorruptEngine(TransformersEngine):
    """The transformers engine with the last greedy token of prompt 0 replaced: by the least
    likely token (`least_likely`, never a near-tie) or by transformers' runner-up. The last,
    so no later token of the engine's depends on it."""

    name: ClassVar[str] = "corrupt"
    least_likely = True

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generation:
        import torch

        g = super().generate(prompts, max_new_tokens)
        ids = torch.tensor([prompts[0] + g.tokens[0][:-1]])
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0, -1]
        order = logits.argsort(descending=True)
        g.tokens[0][-1] = int(order[-1] if self.least_likely else order[1])
        return g


class RunnerUpEngine(CorruptEngine):
    least_likely = False


class OverAllocatingEngine(TransformersEngine):
    """The transformers engine reporting a KV cache twice what it holds (a conversion that
    would not save memory in the engine)."""

    name: ClassVar[str] = "overallocating"

    def kv_allocation(self) -> KvAllocation:
        a = super().kv_allocation()
        return KvAllocation(bytes_per_token=2 * a.bytes_per_token, capacity_tokens=a.capacity_tokens,
                            total_bytes=2 * a.total_bytes, detail=a.detail)


STEP_WEIGHT_BYTES = 5000   # weight bytes a step reads, as a storing engine states them
STEP_KV_PER_TOKEN = 77     # KV bytes per token in its own storage


class StoringEngine(FakeEngine):
    """A fake that keeps the model in its own types and says what a step reads (`step_bytes`)."""

    name: ClassVar[str] = "storing"

    def step_bytes(self) -> tuple[int, int]:
        return STEP_WEIGHT_BYTES, STEP_KV_PER_TOKEN
