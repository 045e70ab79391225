"""Paired data for encoder-decoders: a JSONL file of `{"input": ..., "target": ...}` objects,
one a line (the field names are settings), read whole with the sha256 that records which
file was used. A line that is not a JSON object, or lacks a field, or holds a non-string in
one, is one line naming the file and the line number; blank lines are skipped."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

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
