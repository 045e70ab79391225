"""core.spans: T5 span corruption is lossless, seeded by (seed, index) and T5's proportions."""

from __future__ import annotations

import pytest

from gqakit.core.errors import GqakitError
from gqakit.core.spans import SpanCorruption, sentinel_ids
from tests.tiny_models import SENTINELS, seq2seq_tokenizer

SENT = list(range(1000, 1000 - 100, -1))


def rebuild(inputs: list[int], targets: list[int]) -> list[int]:
    """The original ids from a corrupted pair (each sentinel in the input replaced by its span)."""
    spans: dict[int, list[int]] = {}
    cur = None
    for t in targets[:-1]:
        if t in SENT:
            cur = t
            spans[cur] = []
        else:
            spans[cur].append(t)
    out: list[int] = []
    for t in inputs[:-1]:
        out += spans[t] if t in SENT else [t]
    return out


@pytest.mark.parametrize("length", [2, 3, 10, 57, 512])
def test_corruption_is_lossless_and_sized(length):
    sc = SpanCorruption()
    ids = list(range(length))
    inputs, targets = sc.corrupt(ids, SENT, seed=3, index=7, eos_id=-1)
    assert rebuild(inputs, targets) == ids
    assert (len(inputs), len(targets)) == sc.lengths(length)
    mask = sc.noise_mask(length, seed=3, index=7)
    assert sum(mask) == sc.spans(length)[0] and not mask[0]  # a kept run comes first
    if length >= 100:
        assert abs(sum(mask) / length - 0.15) < 0.01
        runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
        assert abs(sum(mask) / runs - 3.0) < 0.5


def test_seeded_by_seed_and_index_only():
    sc = SpanCorruption()
    a = [sc.noise_mask(200, seed=0, index=i) for i in range(5)]
    assert a == [sc.noise_mask(200, seed=0, index=i) for i in range(5)]       # same seed, same spans
    assert a[::-1] == [sc.noise_mask(200, seed=0, index=i) for i in reversed(range(5))]  # order-free
    assert len({tuple(m) for m in a}) == 5                                     # each index its own spans
    assert sc.noise_mask(200, seed=1, index=0) != a[0]


def test_source_length_fills_the_input():
    sc = SpanCorruption()
    n = sc.source_length(512)
    assert sc.lengths(n)[0] <= 512 < sc.lengths(n + 1)[0]
    assert n == 568  # T5's compute_input_and_target_lengths(512, 0.15, 3) gives 568 source tokens


def test_errors_are_one_line():
    with pytest.raises(GqakitError, match="sentinel tokens"):
        sentinel_ids(seq2seq_tokenizer("bart"))
    with pytest.raises(GqakitError, match="shorter seq_len"):
        SpanCorruption(noise_density=0.5, mean_span_length=1.0).corrupt(list(range(64)), SENT[:2], seed=0,
                                                                        index=0, eos_id=None)
    with pytest.raises(GqakitError, match="noise_density"):
        SpanCorruption(noise_density=1.5)


def test_sentinels_of_a_t5_tokenizer_in_order():
    ids = sentinel_ids(seq2seq_tokenizer("t5"))
    assert len(ids) == SENTINELS and ids[0] == max(ids) and ids == sorted(ids, reverse=True)
