"""Perplexity over one long document with a sliding window, plus per-word and per-byte scores.

Token perplexity follows the Hugging Face perplexity guide: windows of `context` tokens
advance by `stride`; each window scores only the tokens the previous window did not, so
every token is scored exactly once and (after the first window) sees at least
`context - stride` tokens of history. `stride == context` gives disjoint chunks (fast,
pessimistic); a small stride approaches the model's true conditional perplexity.

Token perplexity cannot compare models with different tokenizers (a tokenizer that
makes longer tokens has fewer, harder predictions). Bits per byte and word/byte
perplexity normalise the same total negative log-likelihood by units that do not
depend on the tokenizer, as lm-evaluation-harness's WikiText task does:
  word_perplexity = exp(NLL / words), byte_perplexity = exp(NLL / bytes),
  bits_per_byte = NLL / bytes / ln 2   (UTF-8 bytes; words = whitespace-separated).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gqakit.core.errors import GqakitError
from gqakit.core.spans import SpanCorruption
from gqakit.core.text import EvalText, TextSource
from gqakit.core.tokens import bos_id
from gqakit.eval.records import Objective, PerplexityResult


class Window(BaseModel):
    """The sliding window: `context` tokens, advancing by `stride` (None: by `context`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    context: int = 512
    stride: int | None = None

    @model_validator(mode="after")
    def _check(self) -> "Window":
        if self.context < 2:
            raise GqakitError(f"--context must be at least 2 tokens (got {self.context})")
        if self.stride is not None and not 1 <= self.stride <= self.context:
            raise GqakitError(f"--stride must be between 1 and --context ({self.context}); got {self.stride}")
        return self

    @property
    def stride_tokens(self) -> int:
        return self.context if self.stride is None else self.stride


class Spans(BaseModel):
    """Span corruption of held-out text, for an encoder-decoder's perplexity (T5's objective,
    core.spans): the spans depend only on `seed`, the example's index and its length."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    noise_density: float = SpanCorruption.noise_density
    mean_span_length: float = SpanCorruption.mean_span_length

    @model_validator(mode="after")
    def _check(self) -> "Spans":
        self.corruption()  # a density outside (0, 1) or a mean span below 1: one line
        return self

    def corruption(self) -> SpanCorruption:
        return SpanCorruption(noise_density=self.noise_density, mean_span_length=self.mean_span_length)


class PerplexitySettings(BaseModel):
    """What `gqakit eval --data` measures: which text (its first `max_chars` characters; the
    `text_field` column of an hf: dataset), over which window. Checked when built.

    `objective` says of what (None: by the model). A decoder's is `causal_lm`: every token given
    the ones before it, over the window. An encoder-decoder's is of the target tokens given its
    input: `span_corruption` of plain text (`spans`; an input of `window.context` tokens), or
    `paired`, a JSONL file of `input_field` / `target_field` objects (inputs cut to
    `window.context` tokens)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: TextSource
    window: Window = Field(default_factory=Window)
    max_chars: int | None = None
    text_field: str = "text"
    objective: Objective | None = None
    spans: Spans = Field(default_factory=Spans)
    input_field: str = "input"
    target_field: str = "target"

    @field_validator("data", mode="before")
    @classmethod
    def _source(cls, value: Any) -> Any:
        return value if isinstance(value, TextSource) else TextSource(str(value))

    @field_validator("max_chars")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise GqakitError(f"--max-chars must be a positive number of characters; got {value}")
        return value

    @model_validator(mode="after")
    def _objective(self) -> "PerplexitySettings":
        if self.objective in ("span_corruption", "paired"):
            self.check_seq2seq()
        if not self.input_field or not self.target_field or self.input_field == self.target_field:
            raise GqakitError(f"--input-field and --target-field must be two different names; got "
                              f"{self.input_field!r} and {self.target_field!r}")
        return self

    def check_seq2seq(self) -> None:
        """What an encoder-decoder's perplexity cannot take: a --stride, and for paired data an
        hf: dataset or --max-chars."""
        what = self.objective or "span_corruption"
        if self.window.stride is not None:
            raise GqakitError(f"--stride applies to a decoder's sliding window; {what} perplexity scores "
                              "disjoint examples of --context input tokens")
        if what == "paired":
            if self.data.is_dataset:
                raise GqakitError(f"--objective paired reads a JSONL file of {self.input_field}/{self.target_field} "
                                  f"objects, not a dataset ({self.data})")
            if self.max_chars is not None:
                raise GqakitError("--max-chars applies to plain text, not to paired data")

    def objective_for(self, encoder_decoder: bool, model: str | Path, *, features: bool = False) -> str:
        """The objective for this model (one line when it cannot take the one asked for).
        `features`: the model's encoder reads audio features, so its data is paired features
        and target texts in a .safetensors file (core.pairs.read_feature_pairs)."""
        from gqakit.core.pairs import is_feature_file

        if features:
            if self.objective not in (None, "paired"):
                raise GqakitError(f"{model} reads audio features: its perplexity is --objective paired on a "
                                  f".safetensors file of input features and target texts, not {self.objective}")
            if self.data.is_dataset or not is_feature_file(self.data.spec):
                raise GqakitError(f"{model} reads audio features: --data must be a .safetensors file of input "
                                  f"features ({self.input_field!r}) and target texts (metadata {self.target_field!r}); "
                                  f"got {self.data}")
            if self.window.stride is not None or self.max_chars is not None:
                raise GqakitError("--stride and --max-chars apply to text, not to paired audio features")
            return "paired"
        if self.objective == "paired" and is_feature_file(self.data.spec):
            raise GqakitError(f"{self.data} holds audio features, and {model} reads "
                              + ("token ids: its paired data is a JSONL file of input/target objects"
                                 if encoder_decoder else "text: it is decoder-only (its perplexity is causal_lm)"))
        if self.objective is None:
            if encoder_decoder:
                self.check_seq2seq()
                return "span_corruption"
            return "causal_lm"
        if encoder_decoder and self.objective == "causal_lm":
            raise GqakitError(f"{model} is an encoder-decoder: its perplexity is of target tokens given an input, "
                              "--objective span_corruption (plain text) or paired (input/target JSONL)")
        if not encoder_decoder and self.objective != "causal_lm":
            raise GqakitError(f"--objective {self.objective} needs an encoder-decoder model; {model} is "
                              "decoder-only (its perplexity is causal_lm)")
        return self.objective

    def read(self) -> EvalText:
        """The text to score (before the model loads: a bad file fails first)."""
        return self.data.read(max_chars=self.max_chars, text_field=self.text_field)


def tokenize_document(tokenizer: Any, text: str, bos_token_id: int | None) -> tuple[list[int], bool]:
    """Token ids of the whole document with exactly one BOS at the start.

    Returns (ids, prepended). The first token is context only (never scored), so without
    a BOS the document's first real token would go unscored; a tokenizer that adds no BOS
    itself (stories260K's, many Llama/SmolLM exports) gets one prepended once.
    """
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "sequence longer than model_max_length" is expected here
    try:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    finally:
        hf_logging.set_verbosity(level)
    bos = bos_token_id if bos_token_id is not None else bos_id(tokenizer)
    if bos is not None and (not ids or ids[0] != bos):
        return [int(bos)] + ids, True
    return ids, False


def window_plan(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) for each window over ids[0:n_tokens].

    Window k feeds ids[k*step : k*step + context] (the last one may be shorter, as in the
    HF guide) and scores the targets at positions first_scored..end-1. Position 0 is
    never a target: nothing precedes it.
    The prediction of position t comes from the logits at t-1, so a window must start at
    or before first_scored - 1; the step is therefore capped at context - 1. (The HF
    guide's loop with stride == context silently drops the first token of every window.)
    """
    if n_tokens < 2:
        return []
    step = min(stride, context - 1)
    plan, begin, prev_end = [], 0, 1
    while prev_end < n_tokens:
        end = min(begin + context, n_tokens)
        plan.append((begin, end, prev_end))
        begin, prev_end = begin + step, end
    return plan


def sliding_nll(model: Any, ids: list[int], *, context: int, stride: int, device: Any = "cpu",
                progress: bool = True) -> tuple[float, int, int]:
    """(total NLL in nats, tokens scored, windows) of `ids` under `model`."""
    import torch
    from tqdm.auto import tqdm

    plan = window_plan(len(ids), context, stride)
    all_ids = torch.tensor(ids, dtype=torch.long)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for begin, end, first in tqdm(plan, desc="perplexity", unit="window", disable=not progress):
            x = all_ids[begin:end].unsqueeze(0).to(device)
            logits = model(input_ids=x, use_cache=False).logits[0].float()
            # logits[j] predicts ids[begin + j + 1]; score targets first..end-1.
            pred = logits[first - begin - 1: end - begin - 1]
            tgt = all_ids[first:end].to(pred.device)
            nll += torch.nn.functional.cross_entropy(pred, tgt, reduction="sum").item()
            count += end - first
    return nll, count, len(plan)


def count_words(text: str) -> int:
    """Whitespace-separated words, as lm-evaluation-harness counts them for word perplexity."""
    return len(re.split(r"\s+", text.strip())) if text.strip() else 0


def evaluate_perplexity(model: Any, tokenizer: Any, doc: EvalText, window: Window, *, device: Any = "cpu",
                        max_positions: int | None = None, progress: bool = True) -> PerplexityResult:
    """Token, word and byte perplexity and bits per byte of `doc` under `model`."""
    context, stride = window.context, window.stride_tokens
    if max_positions is not None and context > max_positions:
        raise GqakitError(f"--context {context} is larger than the model's {max_positions} positions")
    bos = bos_id(tokenizer, model.config)
    ids, prepended = tokenize_document(tokenizer, doc.text, bos)
    if len(ids) < context:
        raise GqakitError(f"the data has {len(ids)} tokens, shorter than one window of --context {context}; "
                          "use more text or a smaller --context")
    nll, count, windows = sliding_nll(model, ids, context=context, stride=stride, device=device, progress=progress)
    words, nbytes = count_words(doc.text), len(doc.text.encode("utf-8"))
    return PerplexityResult(
        context=context, stride=stride, step=min(stride, context - 1), tokens=count, windows=windows, nll_sum=nll, words=words, bytes=nbytes,
        token_perplexity=math.exp(nll / count), word_perplexity=math.exp(nll / words),
        byte_perplexity=math.exp(nll / nbytes), bits_per_byte=nll / nbytes / math.log(2),
        bos_prepended=prepended,
        tokenizer={"name_or_path": str(getattr(tokenizer, "name_or_path", "")), "class": type(tokenizer).__name__,
                   "vocab_size": len(tokenizer), "bos_token_id": bos},
        data=doc.describe(),
    )
