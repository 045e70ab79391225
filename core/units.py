"""Units every stage shares: the one parser of byte sizes and the one table of float dtypes.

Torch-free: a dtype's torch object is looked up by name only when asked for (`DType.torch`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gqakit.core.errors import GqakitError

# ----------------------------------------------------------------------------- sizes

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)([bB]?)\s*")


def parse_size(text: str | int, *, gb: int = 1000, default_unit: str = "", what: str = "") -> int:
    """Bytes in a size: '2GB', '500MB', '24GiB', '10K', '80' or an int (taken as bytes).

    `gb` is what a unit without "i" counts in: 1000 (a file size, as Hugging Face's
    `max_shard_size` reads '2GB') or 1024 (a memory size, as GPUs are sold: '80GB' is 80 GiB).
    'KiB', 'MiB', 'GiB', 'TiB' are powers of 1024 either way. `default_unit` applies to a bare
    number ('' = bytes). `what` names the option in the errors: with it, a size that is not
    more than zero is refused too, in that option's words; without it, only a spelling that is
    not a size is ('invalid size ...'), and the caller checks the value."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE.fullmatch(str(text))
    if not m or (m.group(3) and not m.group(2)):
        if what:
            raise GqakitError(f"{what}: {text!r} is not a size such as 80GB or 24GiB")
        raise GqakitError(f"invalid size {text!r}; use e.g. 2GB or 500MB")
    unit = (m.group(2) or default_unit).upper()
    base = 1024 if m.group(3) else gb
    n = float(m.group(1)) * base ** " KMGT".index(unit or " ")
    if what and n <= 0:
        raise GqakitError(f"{what}: {text!r} must be more than zero")
    return int(n)


# ----------------------------------------------------------------------------- dtypes


@dataclass(frozen=True)
class DType:
    """A float dtype: torch's name for it, its bytes per element, the other names it goes by."""

    name: str
    bytes: int
    aliases: tuple[str, ...] = ()

    def torch(self) -> Any:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.name)


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float64", 8, ("fp64",)),
    DType("float32", 4, ("fp32",)),
    DType("bfloat16", 2, ("bf16",)),
    DType("float16", 2, ("fp16",)),
    DType("float8_e4m3fn", 1),
    DType("float8_e5m2", 1),
)}
_BY_ALIAS = {a: d for d in DTYPES.values() for a in (d.name, *d.aliases)}

# The dtypes a model is computed or saved in by gqakit (convert --dtype, eval --dtype, the
# uptrain precisions), in the order the options list them.
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# Bytes per element of every float dtype a config.json may name for its weights.
DTYPE_BYTES = {d.name: d.bytes for d in DTYPES.values()}


def dtype_named(name: str) -> DType | None:
    """The dtype a name, an alias ('bf16') or torch's spelling ('torch.bfloat16') means; None
    for any other string."""
    return _BY_ALIAS.get(name.removeprefix("torch."))


def torch_dtype(name: str) -> Any:
    """The torch dtype of a name or alias in the table (KeyError for any other)."""
    d = dtype_named(name)
    if d is None:
        raise KeyError(name)
    return d.torch()


# ---- how a size names its dtype

_WIDTHS = {8: "64-bit", 4: "32-bit", 2: "16-bit", 1: "8-bit"}


def config_dtype(config: Mapping[str, Any]) -> str | None:
    """The float dtype a config.json says its weights are saved in (`dtype`, or the older
    `torch_dtype`), or None where it names none."""
    for key in ("dtype", "torch_dtype"):
        v = config.get(key)
        if isinstance(v, str) and v.removeprefix("torch.") in DTYPES:
            return v.removeprefix("torch.")
    return None


def dtype_label(bytes_per_elem: int, dtype: str | None = None) -> str:
    """How a KV-cache size names its element type: the dtype when known, else its width ("16-bit")."""
    return dtype or _WIDTHS.get(bytes_per_elem, f"{bytes_per_elem} bytes/element")


def kv_bytes_text(nbytes: float, dtype: str) -> str:
    """KV-cache bytes per token as gqakit prints them everywhere: '640 B/token (bfloat16)'.
    `nbytes` comes from `Shape.kv_bytes_per_token`, the one definition."""
    return f"{nbytes:,.0f} B/token ({dtype})"
