"""Text inputs shared by every stage: a local file, or `hf:NAME[:CONFIG][:SPLIT]` from the
local datasets cache (offline), with the sha256 that records which text was used."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError, first_line


@dataclass
class EvalText:
    """The evaluation document and where it came from (recorded with every number)."""

    text: str
    source: str
    sha256: str
    max_chars: int | None = None

    def describe(self) -> dict[str, Any]:
        return {"path": self.source, "sha256": self.sha256, "chars": len(self.text), "max_chars": self.max_chars}


@dataclass(frozen=True)
class TextSource:
    """Where a text comes from, decided once from what the user typed: a local file, or a
    Hugging Face dataset `hf:NAME[:CONFIG][:SPLIT]` read from the local datasets cache.

    `file` is the local file (None for a dataset): the path every "is OUT one of the
    inputs?" check lists. `read` returns the text with its sha256 (EvalText)."""

    spec: str

    def __str__(self) -> str:
        return self.spec

    @property
    def is_dataset(self) -> bool:
        return self.spec.startswith("hf:")

    @property
    def file(self) -> Path | None:
        return None if self.is_dataset else Path(self.spec).expanduser()

    def check_exists(self, what: str = "data file") -> None:
        """A local file that is not there: one line, before anything slow. A dataset is checked when read."""
        if self.file is not None and not self.file.is_file():
            raise GqakitError(f"{what} not found: {self.file}")

    def read(self, *, max_chars: int | None = None, text_field: str = "text") -> EvalText:
        """The text (its first `max_chars` characters), with the sha256 that records which text was used.

        The sha256 is of the file's bytes for a whole file, and of the text used otherwise, so
        `compare` can tell whether two results were measured on the same data. `max_chars` is
        taken as given (eval's settings check it)."""
        if self.file is None:
            return _read_hf(self.spec, max_chars=max_chars, text_field=text_field)
        self.check_exists()
        p = self.file
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GqakitError(f"data file {p} is not UTF-8 text (byte {e.start})") from None
        # Universal newlines, as Python's text mode reads files: a CRLF file and its LF copy
        # must score the same (a stray "\r" is a rare byte-fallback token that costs a lot).
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        text = _clip(text, max_chars)
        if not text.strip():
            raise GqakitError(f"data file {p} is empty")
        digest = hashlib.sha256(raw if max_chars is None else text.encode("utf-8")).hexdigest()
        return EvalText(text=text, source=str(p.resolve()), sha256=digest, max_chars=max_chars)


def read_text(data: str | TextSource, *, max_chars: int | None = None, text_field: str = "text") -> EvalText:
    """A local text file, or a Hugging Face dataset `hf:NAME[:CONFIG][:SPLIT]` from the local cache
    (TextSource.read)."""
    src = data if isinstance(data, TextSource) else TextSource(str(data))
    return src.read(max_chars=max_chars, text_field=text_field)


def _clip(text: str, max_chars: int | None) -> str:
    return text if max_chars is None else text[:max_chars]


def _read_hf(spec: str, *, max_chars: int | None, text_field: str) -> EvalText:
    parts = spec[3:].split(":")
    name, config = parts[0], (parts[1] or None) if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 else "test"
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types; offline misses are the usual one
        raise GqakitError(f"cannot load dataset {spec} (offline: it must be in the local cache): "
                          f"{first_line(e, None)}") from None
    if text_field not in ds.column_names:
        raise GqakitError(f"dataset {spec} has no column {text_field!r} (columns: {', '.join(ds.column_names)})")
    rows = [r for r in ds[text_field] if r]
    # WikiText rows carry their own newlines; plain sentence datasets do not.
    text = "".join(rows) if rows and all(r.endswith("\n") for r in rows) else "\n".join(rows)
    text = _clip(text, max_chars)
    if not text.strip():
        raise GqakitError(f"dataset {spec} has no text in column {text_field!r}")
    return EvalText(text=text, source=spec, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
                    max_chars=max_chars)
