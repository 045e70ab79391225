"""The decode benchmark's settings, validated once where they enter (CLI, demo, Python API)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from gqakit.core.errors import GqakitError


def parse_ints(text: str, name: str) -> tuple[int, ...]:
    """'1,8,32' -> (1, 8, 32), with a one-line error for anything else."""
    try:
        vals = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise GqakitError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise GqakitError(f"{name} must be positive integers, got {text!r}")
    return vals


def _ints(value: Any, name: str) -> tuple[int, ...]:
    """A grid axis from '1,8,32' or a sequence of positive integers."""
    if isinstance(value, str):
        return parse_ints(value, name)
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    try:
        vals = tuple(value)
    except TypeError:
        raise GqakitError(f"{name} must be comma-separated integers, got {value!r}") from None
    if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
        raise GqakitError(f"{name} must be positive integers, got {value!r}")
    return vals


class SpeedSettings(BaseModel):
    """The grid (`batches` x `prompt_lens`), the timing, and the decode path.

    Strings such as "1,8,32" are accepted for the two grid axes. Every error is one line
    (a `GqakitError`) naming the command-line flag.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    batches: tuple[int, ...] = (1, 8, 32)
    prompt_lens: tuple[int, ...] = (128, 1024)
    new_tokens: int = 128
    reps: int = 5
    warmup: int = 2
    compile: bool = False
    max_batch_search: bool = False
    max_batch_limit: int = 4096
    eager: bool = False          # no packed weights, SDPA decode kernel (the plain transformers step)
    prefill_once: bool = False   # time prefill once per point; decode repetitions rewind the cache to the prompt

    @field_validator("batches", mode="before")
    @classmethod
    def _batches(cls, v: Any) -> tuple[int, ...]:
        return _ints(v, "--batch")

    @field_validator("prompt_lens", mode="before")
    @classmethod
    def _prompt_lens(cls, v: Any) -> tuple[int, ...]:
        return _ints(v, "--prompt-len")

    @model_validator(mode="after")
    def _counts(self) -> "SpeedSettings":
        if self.new_tokens < 1 or self.reps < 1 or self.warmup < 0 or self.max_batch_limit < 1:
            raise GqakitError("--new-tokens, --reps and --max-batch-limit must be at least 1, --warmup at least 0")
        return self

    def check_positions(self, max_positions: int | None) -> None:
        """One-line error when the longest sequence does not fit the model's positions."""
        longest = max(self.prompt_lens) + self.new_tokens
        if max_positions is not None and longest > max_positions:
            raise GqakitError(f"prompt length + new tokens ({longest}) exceeds the model's {max_positions} positions")
