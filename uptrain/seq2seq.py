"""Encoder-decoder training data: T5's span corruption of plain text, or paired input/target rows.

- span_corruption (`core.spans`): text is tokenized and packed as for a decoder (EOS between
  documents), into raw blocks of `SpanCorruption.source_length(train.seq_len)` tokens, the
  most whose corrupted input (EOS included) fits in train.seq_len. A block is corrupted when it
  is drawn: training sample i (the global sample index of `BlockOrder`) gets the spans of
  (train.seed, i), so an epoch's spans differ from the last one's while a resumed run draws
  exactly the spans of the run it continues; held-out block j always gets the spans of
  (`EVAL_SEED`, j), so every run and every seed is scored on the same examples.
- paired: each JSON row gives an input text and a target text (`data.input_field`,
  `data.target_field`), tokenized with the tokenizer's own special tokens and ended by EOS,
  each cut to train.seq_len tokens (EOS kept). A micro-batch is padded to its longest row;
  padding is masked from the encoder and from the loss. An encoder that reads audio features
  takes `.safetensors` files of features and target texts instead (core.pairs.
  read_feature_pairs): the features go to the encoder as they are, the targets are tokenized
  as for text rows and cut to train.seq_len tokens.

All are `Examples`: `batch(blocks, samples)` builds the `Seq2SeqBatch` of the examples
`blocks` drawn as training samples `samples`, and `fingerprint()` identifies the tokenized
data for `--resume`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from gqakit.core.errors import GqakitError
from gqakit.core.pairs import is_feature_file, read_feature_pairs
from gqakit.core.pairs import read_pairs as read_paired_file
from gqakit.core.spans import SpanCorruption, sentinel_ids
from gqakit.uptrain.config import DataCfg
from gqakit.uptrain.data import build_blocks

EVAL_SEED = 0    # held-out spans: the same for every run, whatever train.seed is
IGNORE = -100    # label of a padding position (no loss)


class Seq2SeqBatch(NamedTuple):
    """One micro-batch of an encoder-decoder: encoder input and mask, decoder input and labels."""
    input_ids: torch.Tensor          # [B, S], padded
    attention_mask: torch.Tensor     # [B, S], 1 on real input tokens
    decoder_input_ids: torch.Tensor  # [B, T]: the labels shifted right after the decoder's start token
    labels: torch.Tensor             # [B, T], IGNORE on padding
    input_features: torch.Tensor | None = None  # [B, bins, frames]: an audio encoder's input (input_ids empty)

    def to(self, device: Any) -> Seq2SeqBatch:
        return Seq2SeqBatch(*(None if t is None else t.to(device) for t in self))

    def inputs(self) -> dict[str, torch.Tensor]:
        """The model's keyword arguments (labels left out: the loss is computed by gqakit)."""
        enc = ({"input_features": self.input_features} if self.input_features is not None
               else {"input_ids": self.input_ids, "attention_mask": self.attention_mask})
        return {**enc, "decoder_input_ids": self.decoder_input_ids}

    def predicted(self) -> int:
        return int((self.labels != IGNORE).sum())


def collate(pairs: Sequence[tuple[list[int], list[int]]], *, pad_id: int, start_id: int) -> Seq2SeqBatch:
    """(input ids, target ids) pairs, padded to the longest of each side."""
    s, t = max(len(x) for x, _ in pairs), max(len(y) for _, y in pairs)
    ids = torch.full((len(pairs), s), pad_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), s), dtype=torch.long)
    labels = torch.full((len(pairs), t), IGNORE, dtype=torch.long)
    dec = torch.full((len(pairs), t), pad_id, dtype=torch.long)
    for i, (x, y) in enumerate(pairs):
        ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
        labels[i, :len(y)] = torch.tensor(y)
        dec[i, 0] = start_id
        dec[i, 1:len(y)] = torch.tensor(y[:-1])
    return Seq2SeqBatch(ids, mask, dec, labels)


class SpanExamples:
    """Raw blocks [N, source length], span-corrupted when drawn (see the module docstring)."""

    def __init__(self, blocks: torch.Tensor, corruption: SpanCorruption, sentinels: list[int], *, eos_id: int | None,
                 pad_id: int, start_id: int, seed: int):
        self.blocks, self.corruption, self.sentinels = blocks, corruption, sentinels
        self.eos_id, self.pad_id, self.start_id, self.seed = eos_id, pad_id, start_id, seed

    def __len__(self) -> int:
        return len(self.blocks)

    def batch(self, blocks: Sequence[int], samples: Sequence[int]) -> Seq2SeqBatch:
        pairs = [self.corruption.corrupt(self.blocks[b].tolist(), self.sentinels, seed=self.seed, index=s,
                                         eos_id=self.eos_id) for b, s in zip(blocks, samples)]
        return collate(pairs, pad_id=self.pad_id, start_id=self.start_id)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.blocks.contiguous().numpy().data).hexdigest()


class PairedExamples:
    """Tokenized (input, target) rows; an example is drawn as it is."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]], *, pad_id: int, start_id: int):
        self.pairs, self.pad_id, self.start_id = pairs, pad_id, start_id

    def __len__(self) -> int:
        return len(self.pairs)

    def batch(self, blocks: Sequence[int], samples: Sequence[int]) -> Seq2SeqBatch:
        return collate([self.pairs[b] for b in blocks], pad_id=self.pad_id, start_id=self.start_id)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for x, y in self.pairs:
            h.update(np.asarray([len(x), len(y), *x, *y], dtype=np.int64).tobytes())
        return h.hexdigest()


class FeatureExamples:
    """Audio features [N, bins, frames] and tokenized targets; an example is drawn as it is."""

    def __init__(self, features: torch.Tensor, targets: list[list[int]], *, pad_id: int, start_id: int):
        self.features, self.targets, self.pad_id, self.start_id = features, targets, pad_id, start_id

    def __len__(self) -> int:
        return len(self.targets)

    def batch(self, blocks: Sequence[int], samples: Sequence[int]) -> Seq2SeqBatch:
        b = collate([([], self.targets[i]) for i in blocks], pad_id=self.pad_id, start_id=self.start_id)
        return b._replace(input_features=self.features[list(blocks)])

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.features.contiguous().numpy().data)
        for y in self.targets:
            h.update(np.asarray([len(y), *y], dtype=np.int64).tobytes())
        return h.hexdigest()


def feature_examples(files: Sequence[Path], cfg: DataCfg, tokenizer: Any, max_len: int, eos_id: int | None,
                     what: str, **ids: int) -> FeatureExamples:
    """The features and targets of `.safetensors` paired files, in file order (one frame count)."""
    try:
        data = [read_feature_pairs(f, input_field=cfg.input_field, target_field=cfg.target_field) for f in files]
    except GqakitError as e:
        raise GqakitError(f"{what}: {e}") from None
    if len({d.features.shape[1:] for d in data}) > 1:
        raise GqakitError(f"{what}: the files' features differ in shape ({[list(d.features.shape) for d in data]})")
    targets = encode(tokenizer, [t for d in data for t in d.targets], max_len, eos_id)
    return FeatureExamples(torch.cat([d.features for d in data]), targets, **ids)


# --------------------------------------------------------------------------- paired rows


def read_pairs(files: Sequence[Path], input_field: str, target_field: str, what: str) -> list[tuple[str, str]]:
    """(input, target) texts of JSON-lines files (`core.pairs`: a row without either field, or
    not JSON, is one line naming the file and the line number)."""
    try:
        rows = [(p.input, p.target) for f in files
                for p in read_paired_file(f, input_field=input_field, target_field=target_field).pairs]
    except GqakitError as e:
        raise GqakitError(f"{what}: {e}") from None
    if not rows:
        raise GqakitError(f"{what}: no input/target rows in {[str(f) for f in files]}")
    return rows


def encode(tokenizer: Any, texts: list[str], max_len: int, eos_id: int | None) -> list[list[int]]:
    """Token ids with the tokenizer's own special tokens, EOS last, at most MAX_LEN (EOS kept)."""
    out: list[list[int]] = []
    for i in range(0, len(texts), 1000):
        for ids in tokenizer(texts[i:i + 1000], add_special_tokens=True)["input_ids"]:
            ids = list(ids)
            if eos_id is not None and (not ids or ids[-1] != eos_id):
                ids.append(eos_id)
            if len(ids) > max_len:
                ids = ids[:max_len - 1] + ids[-1:] if eos_id is not None else ids[:max_len]
            out.append(ids)
    return out


def paired(rows: list[tuple[str, str]], tokenizer: Any, max_len: int, eos_id: int | None,
           **ids: int) -> PairedExamples:
    xs = encode(tokenizer, [x for x, _ in rows], max_len, eos_id)
    ys = encode(tokenizer, [y for _, y in rows], max_len, eos_id)
    return PairedExamples(list(zip(xs, ys)), **ids)


# --------------------------------------------------------------------------- build


def build_examples(cfg: DataCfg, tokenizer: Any, model_config: Any, seq_len: int, seed: int, *,
                   files: Sequence[Path], eval_files: Sequence[Path], main_first: Callable[[], Any] = nullcontext,
                   is_main: bool = True, progress: bool = True) -> tuple[Any, Any | None]:
    """(training examples, held-out examples or None) for `data.objective` span_corruption or
    paired; SEQ_LEN is the encoder's input length."""
    eos = tokenizer.eos_token_id
    pad = next((i for i in (model_config.pad_token_id, tokenizer.pad_token_id) if i is not None), 0)
    start = model_config.decoder_start_token_id
    ids = {"pad_id": pad, "start_id": pad if start is None else start}
    if cfg.objective == "paired" and files and is_feature_file(files[0]):
        train = feature_examples(files, cfg, tokenizer, seq_len, eos, "data.files", **ids)
        held = feature_examples(eval_files, cfg, tokenizer, seq_len, eos, "data.eval_file", **ids) if eval_files \
            else None
        if held is not None and cfg.eval_max_blocks:
            held.features, held.targets = held.features[:cfg.eval_max_blocks], held.targets[:cfg.eval_max_blocks]
        return train, held
    if cfg.objective == "paired":
        train = paired(read_pairs(files, cfg.input_field, cfg.target_field, "data.files"), tokenizer, seq_len, eos,
                       **ids)
        held = None
        if eval_files:
            held = paired(read_pairs(eval_files, cfg.input_field, cfg.target_field, "data.eval_file"), tokenizer,
                          seq_len, eos, **ids)
            if cfg.eval_max_blocks:
                held.pairs = held.pairs[:cfg.eval_max_blocks]
        return train, held

    corruption = SpanCorruption(cfg.noise_density, cfg.mean_span_length)
    sentinels = sentinel_ids(tokenizer)
    source = corruption.source_length(seq_len)
    spans = corruption.spans(source)[1]
    if spans > len(sentinels):
        raise GqakitError(f"train.seq_len: {seq_len} gives {spans} noise spans per example, and the tokenizer has "
                          f"{len(sentinels)} sentinel tokens; use a shorter train.seq_len")
    raw, raw_held = build_blocks(cfg, tokenizer, source, files=files, eval_files=eval_files, main_first=main_first,
                                 is_main=is_main, progress=progress,
                                 block=f"{source} tokens (a span-corrupted input of train.seq_len={seq_len})")
    train = SpanExamples(raw, corruption, sentinels, eos_id=eos, seed=seed, **ids)
    held = None if raw_held is None else SpanExamples(raw_held, corruption, sentinels, eos_id=eos, seed=EVAL_SEED,
                                                      **ids)
    return train, held
