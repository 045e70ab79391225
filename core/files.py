"""Small helpers on files that every stage uses."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """The hex sha256 of a file's bytes, read in chunks (memory stays flat)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def format_bytes(n: float | None, *, digits: int = 2, thousands: bool = True, largest: str = "TiB") -> str:
    """A byte count in binary units: `format_bytes(3 << 30)` -> '3.00 GiB'; whole bytes below 1 KiB;
    'n/a' for None."""
    if n is None:
        return "n/a"
    sep = "," if thousands else ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == largest:
            return f"{n:{sep}.0f} {unit}" if unit == "B" else f"{n:{sep}.{digits}f} {unit}"
        n /= 1024
    return str(n)
