"""`--kv-budget B`: a fraction of the source's KV cache (`0.25`, `1/3`, in (0, 1]) or bytes
per token with a unit (`12KiB`, `3072B`; `core.units.parse_size`). Torch-free."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict

from gqakit.core.errors import GqakitError
from gqakit.core.units import parse_size

_FRACTION = re.compile(r"\s*(\d*\.?\d+)\s*(?:/\s*(\d*\.?\d+)\s*)?")


class KvBudget(BaseModel):
    """A KV-cache budget per token, as given: `fraction` of the source's cache, or `bytes`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str
    fraction: str | None = None  # exact, as "p/q" (Fraction's spelling)
    bytes: int | None = None

    @classmethod
    def parse(cls, value: Any) -> KvBudget:
        """A number without a unit is a fraction in (0, 1]; a number with a unit is bytes."""
        if isinstance(value, KvBudget):
            return value
        if isinstance(value, dict):
            return cls(**value)
        text = str(value).strip()
        m = _FRACTION.fullmatch(text)
        if m:
            try:
                f = Fraction(m.group(1)) / (Fraction(m.group(2)) if m.group(2) else 1)
            except ZeroDivisionError:
                f = Fraction(0)
            if not 0 < f <= 1:
                raise GqakitError(f"--kv-budget {text}: a fraction of the source's KV cache is in (0, 1]; bytes "
                                  "per token take a unit, e.g. 12KiB or 3072B")
            return cls(text=text, fraction=str(f))
        return cls(text=text, bytes=parse_size(text, gb=1024, what=f"--kv-budget {text}"))

    def bytes_of(self, full: int) -> int:
        """The budget in bytes per token, for a source whose cache is `full` bytes per token."""
        if self.bytes is not None:
            return self.bytes
        return int(Fraction(self.fraction) * full)  # floor: the budget is never exceeded

    def __str__(self) -> str:
        return self.text
