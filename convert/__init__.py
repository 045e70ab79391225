"""gqakit.convert: MHA -> GQA conversion of Hugging Face checkpoints and GGUF files."""

from __future__ import annotations

from typing import Any


def convert_checkpoint(*args: Any, **kwargs: Any) -> Any:
    """See `gqakit.convert.pipeline.convert_checkpoint` (imported lazily: torch is slow to import)."""
    from gqakit.convert.pipeline import convert_checkpoint as _convert

    return _convert(*args, **kwargs)


def convert_gguf(*args: Any, **kwargs: Any) -> Any:
    """See `gqakit.convert.pipeline.convert_gguf` (imported lazily: torch is slow to import)."""
    from gqakit.convert.pipeline import convert_gguf as _convert

    return _convert(*args, **kwargs)


__all__ = ["convert_checkpoint", "convert_gguf"]
