"""Paired data for encoder-decoders: a JSONL file of `{"input": ..., "target": ...}` objects,
one a line (the field names are settings), read whole with the sha256 that records which
file was used. A line that is not a JSON object, or lacks a field, or holds a non-string in
one, is one line naming the file and the line number; blank lines are skipped.

An encoder that reads audio features (the architecture table's `encoder.input: features`)
takes a `.safetensors` file instead (`read_feature_pairs`): the tensor named by the input
field holds every example's features, `[examples, bins, frames]` (e.g. log-mel spectrograms
as the model's feature extractor makes them), and the file's metadata entry named by the
target field holds the targets, a JSON list of one string per example:

    save_file({"input": features}, "pairs.safetensors", metadata={"target": json.dumps(texts)})
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError
from gqakit.core.text import EvalText


@dataclass(frozen=True)
class Pair:
    input: str
    target: str
    line: int  # 1-based line number in the file


@dataclass
class PairedData:
    """The pairs, and the file they came from (`doc`: its text and sha256, as for plain text)."""

    pairs: list[Pair]
    doc: EvalText
    input_field: str
    target_field: str

    def describe(self) -> dict[str, object]:
        return {**self.doc.describe(), "examples": len(self.pairs)}


def read_pairs(path: str | Path, *, input_field: str = "input", target_field: str = "target") -> PairedData:
    """Every pair of a JSONL file, in file order."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise GqakitError(f"paired data file not found: {p}")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GqakitError(f"paired data file {p} is not UTF-8 text (byte {e.start})") from None
    pairs: list[Pair] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise GqakitError(f"{p} line {n}: not valid JSON ({e.msg}); paired data is one JSON object a line, "
                              f'e.g. {{"{input_field}": "...", "{target_field}": "..."}}') from None
        if not isinstance(row, dict):
            raise GqakitError(f"{p} line {n}: a JSON {type(row).__name__}, not an object with "
                              f"{input_field!r} and {target_field!r} fields")
        for field in (input_field, target_field):
            if field not in row:
                have = ", ".join(repr(k) for k in list(row)[:6]) or "none"
                raise GqakitError(f"{p} line {n}: no {field!r} field (fields: {have})")
            if not isinstance(row[field], str):
                raise GqakitError(f"{p} line {n}: field {field!r} must be a string, not {type(row[field]).__name__}")
        pairs.append(Pair(row[input_field], row[target_field], n))
    if not pairs:
        raise GqakitError(f"paired data file {p} holds no {input_field}/{target_field} pairs")
    doc = EvalText(text=text, source=str(p.resolve()), sha256=hashlib.sha256(raw).hexdigest())
    return PairedData(pairs, doc, input_field, target_field)


FEATURE_SUFFIX = ".safetensors"


def is_feature_file(path: str | Path) -> bool:
    """Whether a paired data file is audio features (`.safetensors`) rather than JSONL."""
    return Path(str(path)).suffix.lower() == FEATURE_SUFFIX


@dataclass
class FeaturePairs:
    """Audio features and their target texts (`features[i]` is `[bins, frames]` for `targets[i]`)."""

    features: Any  # torch.Tensor [examples, bins, frames]
    targets: list[str]
    doc: EvalText  # the targets' text (one a line) and the file's sha256
    input_field: str
    target_field: str

    def describe(self) -> dict[str, object]:
        n, bins, frames = self.features.shape
        return {**self.doc.describe(), "examples": n, "feature_bins": bins, "feature_frames": frames}


def read_feature_pairs(path: str | Path, *, input_field: str = "input", target_field: str = "target") -> FeaturePairs:
    """The features and targets of a `.safetensors` paired data file, checked against each other."""
    from safetensors import SafetensorError, safe_open

    p = Path(path).expanduser()
    if not p.is_file():
        raise GqakitError(f"paired data file not found: {p}")
    raw = p.read_bytes()
    try:
        with safe_open(str(p), framework="pt") as f:
            meta, names = f.metadata() or {}, list(f.keys())
            if input_field not in names:
                raise GqakitError(f"{p} has no {input_field!r} tensor of input features (tensors: "
                                  f"{', '.join(repr(n) for n in names[:6]) or 'none'})")
            features = f.get_tensor(input_field)
    except (SafetensorError, OSError, ValueError) as e:
        raise GqakitError(f"paired data file {p} is not a readable safetensors file: {e}") from None
    if features.dim() != 3 or not features.is_floating_point() or 0 in features.shape:
        raise GqakitError(f"{p}: tensor {input_field!r} must be floating-point [examples, bins, frames]; got "
                          f"{features.dtype} {list(features.shape)}")
    try:
        targets = json.loads(meta[target_field])
    except KeyError:
        raise GqakitError(f"{p} has no {target_field!r} metadata entry (a JSON list of one target text per "
                          f"example; entries: {', '.join(repr(k) for k in list(meta)[:6]) or 'none'})") from None
    except json.JSONDecodeError as e:
        raise GqakitError(f"{p}: metadata {target_field!r} is not valid JSON ({e.msg})") from None
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise GqakitError(f"{p}: metadata {target_field!r} must be a JSON list of strings")
    if len(targets) != features.shape[0]:
        raise GqakitError(f"{p}: {len(targets)} targets for {features.shape[0]} examples of input features")
    doc = EvalText(text="\n".join(targets), source=str(p.resolve()), sha256=hashlib.sha256(raw).hexdigest())
    return FeaturePairs(features.float(), targets, doc, input_field, target_field)
