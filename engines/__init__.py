"""Serving engines gqakit loads its outputs into: one protocol (`base.Engine`), found by name.

Each entry is imported on first use, so `import gqakit.engines` imports no torch and no
engine package.
"""

from __future__ import annotations

import importlib

from gqakit.core.errors import GqakitError
from gqakit.engines.base import Engine, EngineMissing, EngineOptions, Generation, KvAllocation, PointTiming

ENGINES: dict[str, str] = {
    "vllm": "gqakit.engines.vllm:VllmEngine",
}

__all__ = ["ENGINES", "Engine", "EngineMissing", "EngineOptions", "Generation", "KvAllocation", "PointTiming",
           "get_engine"]


def get_engine(name: str) -> Engine:
    """A new, unloaded engine called NAME."""
    if name not in ENGINES:
        raise GqakitError(f"unknown engine {name!r}; the engines are: {', '.join(sorted(ENGINES))}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)()
