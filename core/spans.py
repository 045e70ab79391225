"""T5's span corruption: the pre-training objective of T5, mT5 and the GQA paper's uptraining.

A sequence of token ids is split into noise spans (about `noise_density` of the tokens, in
spans of mean length `mean_span_length`) and the tokens around them. The encoder's input
keeps the tokens around the spans, each span replaced by one sentinel; the decoder's target
is each sentinel followed by the span it stands for:

    ids      a b c d e f g h
    input    a b <0> e f <1> h </s>
    target   <0> c d <1> g </s>

The spans depend only on (`seed`, `index`, the sequence's length), never on the order
examples are drawn in, so a resumed run, or a held-out evaluation, sees the same spans.
The noise mask follows T5's `random_spans_noise_mask`: the number of noise tokens is
rounded from the density, the number of spans from the mean length, and both the noise and
the kept tokens are cut into that many non-empty runs at random, kept run first.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gqakit.core.errors import GqakitError

SENTINEL_FORMAT = "<extra_id_{}>"


@dataclass(frozen=True)
class SpanCorruption:
    noise_density: float = 0.15
    mean_span_length: float = 3.0

    def __post_init__(self) -> None:
        if not 0.0 < self.noise_density < 1.0:
            raise GqakitError(f"span corruption: noise_density must be between 0 and 1, got {self.noise_density}")
        if self.mean_span_length < 1.0:
            raise GqakitError(f"span corruption: mean_span_length must be at least 1, got {self.mean_span_length}")

    def spans(self, length: int) -> tuple[int, int]:
        """(noise tokens, noise spans) for a sequence of `length` tokens."""
        noise = min(max(int(round(length * self.noise_density)), 1), length - 1)
        return noise, max(int(round(noise / self.mean_span_length)), 1)

    def lengths(self, length: int) -> tuple[int, int]:
        """(input, target) lengths, EOS included, of a corrupted sequence of `length` tokens."""
        noise, spans = self.spans(length)
        return length - noise + spans + 1, noise + spans + 1

    def source_length(self, input_length: int) -> int:
        """The most tokens whose corrupted input (EOS included) is at most `input_length` long
        (T5's `compute_input_and_target_lengths`): pack this many per example."""
        n = input_length
        while n < 16 * input_length and self.lengths(n + 1)[0] <= input_length:
            n += 1
        while n > 2 and self.lengths(n)[0] > input_length:
            n -= 1
        return n

    def noise_mask(self, length: int, *, seed: int, index: int) -> list[bool]:
        """True where a token is noise; a function of (seed, index, length) alone."""
        if length < 2:
            raise GqakitError(f"span corruption needs sequences of at least 2 tokens, got {length}")
        noise, spans = self.spans(length)
        spans = min(spans, noise, length - noise)
        rng = random.Random(f"gqakit-spans:{seed}:{index}:{length}")
        noise_runs = _partition(noise, spans, rng)
        kept_runs = _partition(length - noise, spans, rng)
        mask: list[bool] = []
        for kept, noisy in zip(kept_runs, noise_runs):
            mask += [False] * kept + [True] * noisy
        return mask

    def corrupt(self, ids: Sequence[int], sentinels: Sequence[int], *, seed: int, index: int,
                eos_id: int | None) -> tuple[list[int], list[int]]:
        """(encoder input, decoder target) of `ids`; each ends with `eos_id` when it is given.
        `sentinels[i]` replaces the i-th noise span."""
        mask = self.noise_mask(len(ids), seed=seed, index=index)
        inputs: list[int] = []
        targets: list[int] = []
        span = -1
        for i, (tok, noisy) in enumerate(zip(ids, mask)):
            starts = noisy and (i == 0 or not mask[i - 1])
            if starts:
                span += 1
                if span >= len(sentinels):
                    raise GqakitError(f"span corruption needs {span + 1}+ sentinel tokens for {len(ids)}-token "
                                      f"sequences; the tokenizer has {len(sentinels)}: use a shorter seq_len")
                inputs.append(sentinels[span])
                targets.append(sentinels[span])
            (targets if noisy else inputs).append(tok)
        if eos_id is not None:
            inputs.append(eos_id)
            targets.append(eos_id)
        return inputs, targets


def _partition(total: int, parts: int, rng: random.Random) -> list[int]:
    """`total` cut into `parts` non-empty runs at random cut points."""
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def sentinel_ids(tokenizer: Any) -> list[int]:
    """The ids of a tokenizer's sentinel tokens `<extra_id_0>`, `<extra_id_1>`, ... in order
    (T5, mT5, Flan-T5, UL2); a one-line error when it has none."""
    vocab = tokenizer.get_vocab()
    ids: list[int] = []
    while SENTINEL_FORMAT.format(len(ids)) in vocab:
        ids.append(vocab[SENTINEL_FORMAT.format(len(ids))])
    if not ids:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise GqakitError(f"span corruption needs sentinel tokens ({SENTINEL_FORMAT.format(0)}, ...), and the "
                          f"tokenizer of {name} has none: use paired input/target data instead")
    return ids
