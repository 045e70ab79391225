"""gqakit: turn multi-head-attention language models into grouped-query-attention ones.

The Python API (docs/api.md), one call per job; `import gqakit` imports no torch, and each
function imports what it needs when called:

    import gqakit
    gqakit.convert("./llama-mha", "./llama-g2", num_kv_heads=2)            # gqakit convert
    gqakit.uptrain("run.yaml", {"model.path": "./llama-g2"})                 # gqakit uptrain
    result = gqakit.evaluate("./llama-g2", data="valid.txt")                 # gqakit eval
    model_g2 = gqakit.convert_model(model, num_kv_heads=2)                   # in memory
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that holds it: `convert` and `uptrain` are callable packages
API = {"convert": "gqakit.convert", "uptrain": "gqakit.uptrain", "evaluate": "gqakit.api",
       "convert_model": "gqakit.api"}


def __getattr__(name: str) -> Any:
    """`gqakit.convert`, `gqakit.uptrain`, `gqakit.evaluate`, `gqakit.convert_model`, imported on
    first use."""
    if name not in API:
        raise AttributeError(f"module 'gqakit' has no attribute {name!r}")
    module = importlib.import_module(API[name])
    return module if module.__name__ == f"gqakit.{name}" else getattr(module, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *API])


__all__ = ["__version__", "convert", "convert_model", "evaluate", "uptrain"]
