"""Serving engines gqakit measures a model in: one interface (`base.Engine`), one registry.

`ENGINES` maps an engine's name to the class that implements it, imported on first use, so
that `import gqakit.engines` imports no engine package (torch, vllm, llama_cpp).
"""

from __future__ import annotations

from importlib import import_module

from gqakit.core.errors import GqakitError
from gqakit.engines.base import Engine

ENGINES: dict[str, str] = {
    "llama.cpp": "gqakit.engines.llamacpp:LlamaCppEngine",
}


def get_engine(name: str) -> Engine:
    """A new, unloaded engine NAME (one line listing the names for an unknown one)."""
    if name not in ENGINES:
        raise GqakitError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(import_module(module), cls)()
