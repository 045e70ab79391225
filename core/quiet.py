"""`-q`: nothing on stderr but errors.

gqakit's own progress bars take a `progress` flag. The libraries underneath print too:
transformers' "Loading weights" bars and warnings, the GGUF dequantisation bar (a plain
tqdm inside transformers), datasets' and the Hub's bars, accelerate's "Removed shared
tensor" warning, Python warnings. `quiet_libraries()` turns all of them off while it is
active and restores the settings it changed afterwards. It imports nothing heavy: a
library first imported inside the block reads the environment variables set here
(and keeps those quiet defaults in this process).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

# Read by the libraries when they are first imported (inside the block), and by
# `gguf_bars_off` (GQAKIT_QUIET).
ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
       "TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "GQAKIT_QUIET": "1"}
LOGGERS = ("transformers", "accelerate", "datasets", "huggingface_hub", "torch", "gguf", "tensorboard")


@contextmanager
def _env() -> Iterator[None]:
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _loggers() -> Iterator[None]:
    old = {name: logging.getLogger(name).level for name in LOGGERS}
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in old.items():
            logging.getLogger(name).setLevel(level)


@contextmanager
def _transformers() -> Iterator[None]:
    if "transformers" not in sys.modules:  # imported later, inside the block: ENV applies
        yield
        return
    import transformers.utils.logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextmanager
def gguf_bars_off() -> Iterator[None]:
    """Around a GGUF load: its dequantisation bar is a plain tqdm, off only by patching.

    Does something only inside `quiet_libraries` (the caller imports the GGUF loader anyway)."""
    if os.environ.get("GQAKIT_QUIET") != "1":
        yield
        return
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_mod
    except Exception:  # no gguf support installed: the load itself will say so
        yield
        return
    old = gguf_mod.tqdm
    gguf_mod.tqdm = functools.partial(old, disable=True)
    try:
        yield
    finally:
        gguf_mod.tqdm = old


@contextmanager
def _datasets() -> Iterator[None]:
    if "datasets" not in sys.modules:  # imported later, inside the block: ENV applies
        yield
        return
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


@contextmanager
def _hub() -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was:
            enable_progress_bars()


@contextmanager
def quiet_libraries(enabled: bool = True, *, hf: bool = True) -> Iterator[None]:
    """While active (and `enabled`), the libraries gqakit uses print nothing but errors.

    hf=False leaves the Hugging Face libraries unimported (a verb that never loads a
    model, like `compare`, then silences only warnings and logs)."""
    if not enabled:
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(_env())
        stack.enter_context(_loggers())
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        if hf:
            stack.enter_context(_transformers())
            stack.enter_context(_hub())
            stack.enter_context(_datasets())
        yield
