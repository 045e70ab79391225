"""Perplexity: window plan, BOS handling, agreement with independent implementations."""

from __future__ import annotations

import math

import pytest
import torch

from gqakit.core.errors import GqakitError
from gqakit.core.loading import load_causal_lm, load_tokenizer
from gqakit.core.text import read_text
from gqakit.eval.perplexity import Window, count_words, evaluate_perplexity, tokenize_document, window_plan


@pytest.mark.parametrize("n,context,stride", [(10, 4, 4), (10, 4, 2), (100, 16, 5), (5, 8, 8), (17, 16, 1)])
def test_window_plan_scores_every_token_once(n, context, stride):
    plan = window_plan(n, context, stride)
    scored = [t for _, end, first in plan for t in range(first, end)]
    assert scored == list(range(1, n))
    for begin, end, first in plan:
        assert end - begin <= context and begin <= first - 1  # the predicting logit is inside the window


def _reference_nll(model, ids, context):
    """Straightforward: chunks overlapping by one token, HF's own loss, no window bookkeeping."""
    total, n, start = 0.0, 0, 0
    while start < len(ids) - 1:
        x = torch.tensor(ids[start:start + context]).unsqueeze(0)
        with torch.no_grad():
            loss = model(input_ids=x, labels=x).loss.item()
        total += loss * (x.shape[1] - 1)
        n += x.shape[1] - 1
        start += context - 1
    return total, n


def _reference_strided(model, ids, context, stride):
    """The HF guide's masked-label loop, from its description, with the step capped at context-1."""
    total, n, prev_end = 0.0, 0, 1
    end = min(context, len(ids))
    while True:
        begin = max(0, end - context)
        x = torch.tensor(ids[begin:end]).unsqueeze(0)
        labels = x.clone()
        labels[:, : prev_end - begin] = -100
        with torch.no_grad():
            loss = model(input_ids=x, labels=labels).loss.item()
        k = end - prev_end
        total, n = total + loss * k, n + k
        if end == len(ids):
            return total, n
        prev_end, end = end, min(end + min(stride, context - 1), len(ids))


pytestmark = pytest.mark.usefixtures("one_thread")


def test_matches_reference_on_tiny_model(tiny_model, tmp_path):
    folder = tiny_model("llama", num_key_value_heads=2)
    model, tok = load_causal_lm(folder), load_tokenizer(folder)
    text = " ".join("abc defg hij klmno pq rstu vw xyz ABC DEF"[i % 7:] for i in range(40))
    (tmp_path / "d.txt").write_text(text)
    doc = read_text(str(tmp_path / "d.txt"))
    ids, _ = tokenize_document(tok, doc.text, None)
    for context, stride in [(32, 32), (32, 8)]:
        res = evaluate_perplexity(model, tok, doc, Window(context=context, stride=stride), progress=False)
        ref, n = (_reference_nll(model, ids, context) if stride == context
                  else _reference_strided(model, ids, context, stride))
        assert res.tokens == n == len(ids) - 1
        assert res.nll_sum == pytest.approx(ref, rel=1e-5)
        assert res.token_perplexity == pytest.approx(math.exp(ref / n), rel=1e-5)
        assert res.bits_per_byte == pytest.approx(ref / len(text.encode()) / math.log(2), rel=1e-5)
        assert res.word_perplexity == pytest.approx(math.exp(res.nll_sum / len(text.split())), rel=1e-9)


def test_stories260k_against_independent_implementation(shared):
    """Real model: within 0.1% of a plain chunked loop, and near the published 5.5."""
    import sentencepiece as spm

    folder = shared / "models" / "stories260K"
    path = shared / "data" / "tinystories" / "valid-excerpt.txt"
    model, tok = load_causal_lm(folder), load_tokenizer(folder)
    res = evaluate_perplexity(model, tok, read_text(str(path)), Window(context=512, stride=512), progress=False)
    # Independent: sentencepiece tokenizer (not HF's), text-mode file read, BOS id 1 by hand.
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    ids = [1] + sp.encode(path.read_text())
    ref, n = _reference_nll(model, ids, 512)
    assert res.bos_prepended and res.tokens == n
    assert abs(res.token_perplexity / math.exp(ref / n) - 1) < 1e-3
    assert 5.3 < res.token_perplexity < 5.7
    assert res.data["sha256"] and res.context == 512 and res.stride == 512


def test_bos_is_prepended_once(tiny_model):
    tok = load_tokenizer(tiny_model("llama"))
    ids, prepended = tokenize_document(tok, "ab cd", 1)
    assert prepended and ids[0] == 1 and ids.count(1) == 1
    again, prepended2 = tokenize_document(tok, "ab cd", ids[1])  # already starts with it
    assert not prepended2 and again == ids[1:]


def test_word_count_matches_whitespace_split():
    assert count_words("  one two\n\nthree\tfour ") == 4
    assert count_words("") == 0


def test_bad_inputs(tiny_model, tmp_path):
    folder = tiny_model("llama")
    model, tok = load_causal_lm(folder), load_tokenizer(folder)
    with pytest.raises(GqakitError, match="not found"):
        read_text(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(GqakitError, match="empty"):
        read_text(str(tmp_path / "empty.txt"))
    (tmp_path / "short.txt").write_text("a b c")
    doc = read_text(str(tmp_path / "short.txt"))
    with pytest.raises(GqakitError, match="shorter than one window"):
        evaluate_perplexity(model, tok, doc, Window(context=64), progress=False)
    with pytest.raises(GqakitError, match="larger than the model"):
        evaluate_perplexity(model, tok, doc, Window(context=256), max_positions=128, progress=False)
    with pytest.raises(GqakitError, match="--stride"):
        evaluate_perplexity(model, tok, doc, Window(context=8, stride=9), progress=False)
    (tmp_path / "crlf.txt").write_bytes(b"ab cd\r\nef gh\r\n")
    assert read_text(str(tmp_path / "crlf.txt")).text == "ab cd\nef gh\n"
