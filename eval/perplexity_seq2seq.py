"""An encoder-decoder's perplexity: of the target tokens given the input.

Two sources of (input, target) examples:
- `span_corruption`: held-out plain text, tokenized whole (no special tokens), cut into
  consecutive runs of `SpanCorruption.source_length(context)` tokens, and each run corrupted
  as T5 pre-trains (core.spans: the spans depend only on the seed, the run's index and its
  length), so the encoder's input, EOS included, is `context` tokens long. The last, shorter
  run is scored too (from 2 tokens).
- `paired`: a JSONL file of input/target objects (core.pairs), each side tokenized as the
  model's tokenizer does for training (special tokens included); an input longer than
  `context` tokens is cut to it (and counted), a target never is. An encoder that reads audio
  features takes a .safetensors file of features and target texts instead (core.pairs.
  read_feature_pairs): each example's features go to the encoder as they are (`context` is
  then their frames), the target tokenized as for training.

Perplexity = exp(total NLL of the target tokens / their count), each example scored alone
(batch 1: no padding), the decoder teacher-forced on the target (`labels`). Paired data also
gives word and byte perplexity and bits per byte over the targets' text; span-corrupted text
does not (its targets are fragments of words).

Everything that needs no model (reading, tokenizing, the sentinel tokens, the span plan) is
`prepare_*`, run before the model loads; `score` needs the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError, first_line
from gqakit.core.pairs import FeaturePairs, PairedData
from gqakit.core.spans import SpanCorruption, sentinel_ids
from gqakit.core.text import EvalText
from gqakit.eval.perplexity import PerplexitySettings, count_words
from gqakit.eval.records import PairFields, PerplexityResult, SpanInfo


@dataclass
class Examples:
    """(input ids, target ids) to score, and what the result records about them."""

    objective: str
    context: int
    examples: list[tuple[Any, list[int]]]  # (input ids, or audio features [bins, frames]; target ids)
    data: dict[str, Any]
    tokenizer: dict[str, Any]
    lines: list[int] = field(default_factory=list)  # paired: each example's line in the file
    words: int | None = None
    bytes: int | None = None
    truncated: int | None = None
    spans: SpanInfo | None = None
    fields: PairFields | None = None
    source: str = ""


def _quiet_tokenize(tokenizer: Any, *args: Any, **kwargs: Any) -> list[int]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "sequence longer than model_max_length": these are scored in pieces
    try:
        return list(tokenizer(*args, **kwargs)["input_ids"])
    finally:
        hf_logging.set_verbosity(level)


def _tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    return {"name_or_path": str(getattr(tokenizer, "name_or_path", "")), "class": type(tokenizer).__name__,
            "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}


def span_sentinels(tokenizer: Any, model: str | Path) -> list[int]:
    """The tokenizer's sentinel tokens, or one line saying span corruption needs them."""
    try:
        return sentinel_ids(tokenizer)
    except GqakitError:
        raise GqakitError(f"span-corruption perplexity needs the tokenizer's sentinel tokens (<extra_id_0>, ...) and "
                          f"the tokenizer of {model} has none: use --objective paired with an input/target JSONL "
                          "file") from None


def span_context_range(corruption: SpanCorruption, sentinels: int, upto: int) -> tuple[int, int]:
    """(shortest, longest <= upto) input length whose corrupted examples fit: the input holds at
    least one span, and the examples need at most `sentinels` sentinel tokens (longest 0: none)."""
    shortest = 3
    while corruption.lengths(corruption.source_length(shortest))[0] > shortest:
        shortest += 1
    longest = upto
    while longest >= shortest and corruption.spans(corruption.source_length(longest))[1] > sentinels:
        longest -= 1
    return shortest, longest if longest >= shortest else 0


def prepare_span_corruption(tokenizer: Any, doc: EvalText, settings: PerplexitySettings,
                            model: str | Path) -> Examples:
    """The span-corrupted examples of `doc` (before the model loads: every check that needs no model)."""
    sentinels = span_sentinels(tokenizer, model)
    corruption = settings.spans.corruption()
    context = settings.window.context
    n = corruption.source_length(context)
    if corruption.lengths(n)[0] > context or corruption.spans(n)[1] > len(sentinels):
        shortest, longest = span_context_range(corruption, len(sentinels), context)
        if context < shortest:
            raise GqakitError(f"--context {context} is too short for a span-corrupted example: use at least {shortest}")
        raise GqakitError(f"--context {context} makes {corruption.spans(n)[1]} noise spans per example and the "
                          f"tokenizer has {len(sentinels)} sentinel tokens: use --context at most {longest}")
    eos = tokenizer.eos_token_id
    ids = _quiet_tokenize(tokenizer, doc.text, add_special_tokens=False)
    if len(ids) < n:
        raise GqakitError(f"the data has {len(ids)} tokens, fewer than one span-corrupted example of --context "
                          f"{context} input tokens needs ({n}); use more text or a smaller --context")
    seed = settings.spans.seed
    examples = [corruption.corrupt(ids[i:i + n], sentinels, seed=seed, index=k, eos_id=eos)
                for k, i in enumerate(range(0, len(ids) - n + 1, n))]
    # the last, shorter run (if any): scored too when it can hold a span
    tail = ids[len(examples) * n:]
    if len(tail) >= 2:
        examples.append(corruption.corrupt(tail, sentinels, seed=seed, index=len(examples), eos_id=eos))
    spans = SpanInfo(seed=seed, noise_density=corruption.noise_density, mean_span_length=corruption.mean_span_length,
                     source_tokens=n, sentinels=len(sentinels))
    return Examples("span_corruption", context, examples, doc.describe(), _tokenizer_info(tokenizer), spans=spans,
                    source=doc.source)


def prepare_paired(tokenizer: Any, data: PairedData, settings: PerplexitySettings) -> Examples:
    """The tokenized pairs of a JSONL file (core.pairs.read_pairs; before the model loads)."""
    context = settings.window.context
    examples, lines, truncated, words, nbytes = [], [], 0, 0, 0
    for pair in data.pairs:
        inp = _quiet_tokenize(tokenizer, pair.input)
        if len(inp) > context:
            inp = _quiet_tokenize(tokenizer, pair.input, truncation=True, max_length=context)
            truncated += 1
        tgt = _quiet_tokenize(tokenizer, text_target=pair.target)
        if not tgt:
            raise GqakitError(f"{data.doc.source} line {pair.line}: the {data.target_field} has no tokens")
        examples.append((inp, tgt))
        lines.append(pair.line)
        words += count_words(pair.target)
        nbytes += len(pair.target.encode("utf-8"))
    return Examples("paired", context, examples, data.describe(), _tokenizer_info(tokenizer), lines=lines,
                    words=words, bytes=nbytes, truncated=truncated,
                    fields=PairFields(input=data.input_field, target=data.target_field), source=data.doc.source)


def prepare_feature_pairs(tokenizer: Any, data: FeaturePairs) -> Examples:
    """Audio features and their tokenized targets (before the model loads)."""
    examples, words, nbytes = [], 0, 0
    for i, target in enumerate(data.targets):
        tgt = _quiet_tokenize(tokenizer, text_target=target)
        if not tgt:
            raise GqakitError(f"{data.doc.source} example {i}: the {data.target_field} has no tokens")
        examples.append((data.features[i], tgt))
        words += count_words(target)
        nbytes += len(target.encode("utf-8"))
    return Examples("paired", int(data.features.shape[-1]), examples, data.describe(), _tokenizer_info(tokenizer),
                    words=words, bytes=nbytes, fields=PairFields(input=data.input_field, target=data.target_field),
                    source=data.doc.source)


def _input_length(inp: Any) -> int:
    """Tokens of an input, or frames of audio features."""
    return len(inp) if isinstance(inp, list) else int(inp.shape[-1])


def score(model: Any, ex: Examples, *, device: Any = "cpu", max_positions: int | None = None,
          progress: bool = True) -> PerplexityResult:
    """Perplexity of the examples' target tokens under `model`. `max_positions`: a limit of learned
    position embeddings (BART's), which inputs and targets must not pass; None for relative ones (T5's).
    Audio features are checked against the model's own input length by the model."""
    import torch
    from tqdm.auto import tqdm

    features = bool(ex.examples) and not isinstance(ex.examples[0][0], list)
    if features != (getattr(model, "main_input_name", "input_ids") == "input_features"):
        raise GqakitError("the model reads " + ("token ids, and the data is audio features" if features else
                                                "audio features, and the data is token ids"))
    if max_positions is not None:
        if ex.context > max_positions and not features:
            raise GqakitError(f"--context {ex.context} is larger than the model's {max_positions} positions")
        for i, (_, tgt) in enumerate(ex.examples):
            if len(tgt) > max_positions:
                where = f"{ex.source} line {ex.lines[i]}" if ex.lines else f"span-corrupted example {i}"
                raise GqakitError(f"{where}: the target has {len(tgt)} tokens, more than the model's "
                                  f"{max_positions} positions")
    nll, count = 0.0, 0
    with torch.inference_mode():
        for inp, tgt in tqdm(ex.examples, desc="perplexity", unit="example", disable=not progress):
            y = torch.tensor([tgt], dtype=torch.long, device=device)
            if features:
                x = inp[None].to(device=device, dtype=model.dtype)
                try:
                    logits = model(input_features=x, labels=y, use_cache=False).logits[0].float()
                except ValueError as e:  # e.g. features of another length than the model's
                    raise GqakitError(f"{ex.source}: the model refuses the input features: {first_line(e)}") from None
            else:
                x = torch.tensor([inp], dtype=torch.long, device=device)
                logits = model(input_ids=x, labels=y, use_cache=False).logits[0].float()
            nll += torch.nn.functional.cross_entropy(logits, y[0], reduction="sum").item()
            count += len(tgt)
    res: dict[str, Any] = dict(objective=ex.objective, context=ex.context, tokens=count, examples=len(ex.examples),
                               input_tokens=sum(_input_length(i) for i, _ in ex.examples), nll_sum=nll,
                               token_perplexity=math.exp(nll / count), tokenizer=ex.tokenizer, data=ex.data)
    if ex.truncated is not None:
        res["inputs_truncated"] = ex.truncated
    if ex.words and ex.bytes:
        res.update(words=ex.words, bytes=ex.bytes, word_perplexity=math.exp(nll / ex.words),
                   byte_perplexity=math.exp(nll / ex.bytes), bits_per_byte=nll / ex.bytes / math.log(2))
    if ex.spans is not None:
        res["spans"] = ex.spans
    if ex.fields is not None:
        res["fields"] = ex.fields
    return PerplexityResult(**res)
