"""The decode benchmark's settings, validated once where they enter (CLI, demo, Python API)."""

from __future__ import annotations

from typing import Any, Literal

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

    An encoder-decoder's grid is `batches` x `input_lens` x `output_lens` instead: the
    encoder reads an input of `input_lens` tokens once per point, and the timed decoder
    steps start with `output_lens` tokens in the self-attention cache (1: right after the
    decoder's start token). Strings such as "1,8,32" are accepted for the grid axes. Every
    error is one line (a `GqakitError`) naming the command-line flag; `check_model` refuses
    an axis given for the other kind of model.
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
    input_lens: tuple[int, ...] = (512, 2048)   # encoder-decoders: input (encoder) tokens
    output_lens: tuple[int, ...] = (1,)         # encoder-decoders: output tokens cached when the timed steps start
    # what runs the steps (gqakit.engines.ENGINES): gqakit's own runtime, stock transformers
    # (the --eager path), or an external engine timed through `EngineBench`
    engine: Literal["gqakit", "transformers", "vllm", "llama.cpp"] = "gqakit"

    @field_validator("batches", mode="before")
    @classmethod
    def _batches(cls, v: Any) -> tuple[int, ...]:
        return _ints(v, "--batch")

    @field_validator("prompt_lens", mode="before")
    @classmethod
    def _prompt_lens(cls, v: Any) -> tuple[int, ...]:
        return _ints(v, "--prompt-len")

    @field_validator("engine", mode="before")
    @classmethod
    def _engine(cls, v: Any) -> Any:
        names = ("gqakit", "transformers", "vllm", "llama.cpp")
        if v not in names:
            raise GqakitError(f"--engine must be one of {', '.join(names)}; got {v!r}")
        return v

    @field_validator("input_lens", mode="before")
    @classmethod
    def _input_lens(cls, v: Any) -> tuple[int, ...]:
        return _ints(v, "--input-len")

    @field_validator("output_lens", mode="before")
    @classmethod
    def _output_lens(cls, v: Any) -> tuple[int, ...]:
        return _ints(v, "--output-len")

    @model_validator(mode="after")
    def _counts(self) -> "SpeedSettings":
        if self.new_tokens < 1 or self.reps < 1 or self.warmup < 0 or self.max_batch_limit < 1:
            raise GqakitError("--new-tokens, --reps and --max-batch-limit must be at least 1, --warmup at least 0")
        if self.engine not in ("gqakit", "transformers"):
            asked = [f for f, on in (("--compile", self.compile), ("--eager", self.eager),
                                     ("--max-batch-search", self.max_batch_search),
                                     ("--prefill-once", self.prefill_once)) if on]
            if asked:
                raise GqakitError(f"{', '.join(asked)}: for the gqakit and transformers engines; the {self.engine} "
                                  "engine times its own steps")
        if self.engine == "transformers" and self.compile:
            raise GqakitError("--compile is for the gqakit engine; the transformers engine runs stock eager steps")
        return self

    @property
    def plain(self) -> bool:
        """The plain transformers step (no packed weights, SDPA): --eager or --engine transformers."""
        return self.eager or self.engine == "transformers"

    def check_positions(self, max_positions: int | None) -> None:
        """One-line error when the longest sequence does not fit the model's positions."""
        longest = max(self.prompt_lens) + self.new_tokens
        if max_positions is not None and longest > max_positions:
            raise GqakitError(f"prompt length + new tokens ({longest}) exceeds the model's {max_positions} positions")

    def check_model(self, encoder_decoder: bool) -> None:
        """One-line error when a grid axis was given for the other kind of model, or an
        encoder-decoder is asked for what its decode benchmark does not do."""
        given = self.model_fields_set
        if not encoder_decoder and given & {"input_lens", "output_lens"}:
            raise GqakitError("--input-len and --output-len are for encoder-decoder models; "
                              "this model is decoder-only (its grid is --batch x --prompt-len)")
        if encoder_decoder:
            if self.engine not in ("gqakit", "transformers"):
                raise GqakitError(f"--engine {self.engine}: the speed grid of an encoder-decoder runs on the gqakit "
                                  "and transformers engines (see docs/serving.md)")
            if "prompt_lens" in given:
                raise GqakitError("--prompt-len is for decoder-only models; an encoder-decoder's grid is "
                                  "--batch x --input-len x --output-len")
            if self.compile or self.max_batch_search:
                raise GqakitError("--compile and --max-batch-search are for decoder-only models; "
                                  "an encoder-decoder's decode steps run eagerly")

    def check_seq2seq_positions(self, max_input: int | None, max_output: int | None) -> None:
        """One-line error when the longest input or output does not fit an encoder-decoder's positions."""
        longest_in, longest_out = max(self.input_lens), max(self.output_lens) + self.new_tokens
        if max_input is not None and longest_in > max_input:
            raise GqakitError(f"input length {longest_in} exceeds the encoder's {max_input} positions")
        if max_output is not None and longest_out > max_output:
            raise GqakitError(f"output length + new tokens ({longest_out}) exceeds the decoder's {max_output} positions")
