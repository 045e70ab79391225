"""The token rules shared by every stage (core/tokens.py): the BOS rule and the one sampler."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gqakit.core.loading import load_causal_lm
from gqakit.core.tokens import bos_id, sample_tokens


def test_bos_rule():
    tok = SimpleNamespace(bos_token_id=None, eos_token_id=7)
    assert bos_id(SimpleNamespace(bos_token_id=3, eos_token_id=7), {"bos_token_id": 5}) == 3
    assert bos_id(tok, {"bos_token_id": 5}) == 5                     # the config's BOS next
    assert bos_id(tok, SimpleNamespace(bos_token_id=6)) == 6         # a loaded config works the same
    assert bos_id(tok, {}) is None                                   # no BOS: nothing prepended
    assert bos_id(tok, {}, eos_fallback=True) == 7                   # or the EOS, where a start is needed
    assert bos_id(None, {"eos_token_id": [9, 2]}, eos_fallback=True) == 9


def test_sampler_never_draws_the_excluded_tokens(tiny_model):
    model = load_causal_lm(tiny_model("llama"))
    with torch.no_grad():
        top = model(input_ids=torch.tensor([[1]])).logits[0, -1].topk(5).indices.tolist()
    got = sample_tokens(model, [1], 64, 6, never=top, generator=torch.Generator().manual_seed(0))
    assert got.shape == (64, 6) and not torch.isin(got, torch.tensor(top)).any()


def test_sampled_calibration_text_starts_with_bos_and_has_no_eos(tiny_model):
    from gqakit.convert.calibration import calibration_sequences
    from gqakit.convert.source import open_model

    opened = open_model(tiny_model("llama"))
    seqs, where = calibration_sequences(opened, None, 200, 20, seed=0, progress=False)
    again, _ = calibration_sequences(opened, None, 200, 20, seed=0, progress=False)
    assert seqs.shape == (10, 20) and torch.equal(seqs, again) and "sampled" in where
    assert (seqs[:, 0] == 1).all() and not (seqs[:, 1:] == 2).any()  # BOS 1 first; EOS 2 never sampled
