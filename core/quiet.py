"""`-q`: nothing on stderr but errors.

gqakit's own progress bars take a `progress` flag. The libraries underneath print too:
transformers' "Loading weights" bars and warnings, the GGUF dequantisation bar (a plain
tqdm inside transformers), datasets' and the Hub's bars, accelerate's "Removed shared
tensor" warning, Python warnings. `quiet_libraries()` turns all of them off while it is
active and restores the settings it changed afterwards. It imports nothing heavy: a
library first imported inside the block reads the environment variables set here
(and keeps those quiet defaults in this process).

Without `-q` (`quiet_libraries(False)`), what the libraries print goes through the same
place, so it never lands inside a progress bar: their log records (transformers,
accelerate's "Removed shared tensor", torch, ...) and Python warnings (torch's
UserWarnings) are written as whole lines with `tqdm.write`, which clears a bar on the
terminal and redraws it below. When stderr is not a terminal (a log file, a pipe, a CI
job), every tqdm bar, gqakit's and the libraries', is drawn as plain lines instead of
`\r` redraws: one line when it ends, and one every `LINE_SECONDS` while it runs.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

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


LINE_SECONDS = 30.0  # a bar drawn as lines: at most one line this often while it runs


def stderr_is_terminal() -> bool:
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def _line_display(self: Any, msg: str | None = None, pos: int | None = None) -> bool:
    """tqdm's `display` when stderr is not a terminal: a plain line, never a `\r`."""
    if msg == "":  # a request to clear the bar: a line needs none (False: `close` adds no '\r')
        return False
    closing = self.disable  # `close` sets it before its last display, then ends the line itself
    now = time.monotonic()
    last = getattr(self, "_gqakit_line_t", None)
    if last is None:  # the first call comes from tqdm's __init__: the bar has just started
        self._gqakit_line_t = last = now
        if not closing:
            return True
    if not closing and (now - last < LINE_SECONDS or (self.total is not None and self.n >= self.total)):
        return True  # (a finished bar's line comes from `close`, once)
    self._gqakit_line_t = now
    line = " ".join((msg or self.format_meter(**{**self.format_dict, "ncols": 0})).split())
    self.fp.write(line if closing else line + "\n")
    getattr(self.fp, "flush", lambda: None)()
    return True


def _no_op(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def _line_bars() -> Iterator[None]:
    """Every tqdm bar made while active (all derive from `tqdm.std.tqdm`) prints lines."""
    from tqdm import std

    cls = std.tqdm
    new = {"display": _line_display, "clear": _no_op, "moveto": _no_op}
    old = {name: cls.__dict__[name] for name in new}
    for name, fn in new.items():
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for name, fn in old.items():
            setattr(cls, name, fn)


def write_line(text: str) -> None:
    """TEXT on stderr as one line, around any progress bar (a bar on the terminal is
    cleared and redrawn below it)."""
    from tqdm import tqdm

    tqdm.write(" ".join(str(text).split()), file=sys.stderr)


class _BarSafeHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record))
        except Exception:
            self.handleError(record)


def _show_warning(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    write_line(f"{os.path.basename(filename)}:{lineno}: {category.__name__}: {message}")


def _replaceable(h: logging.Handler) -> bool:
    """A handler that prints to the console (or an outer block's own), not to a file."""
    return isinstance(h, _BarSafeHandler) or (
        type(h) is logging.StreamHandler and getattr(h, "stream", None) in (sys.stderr, sys.stdout))


@contextmanager
def _routed(hf: bool) -> Iterator[None]:
    """Log records (the root logger's and those of the libraries with their own console
    handler) and Python warnings are written by `write_line`."""
    if hf:
        try:  # transformers' own console handler exists before it is replaced
            import transformers.utils.logging  # noqa: F401
        except ImportError:
            pass
    handler = _BarSafeHandler()
    targets = [logging.getLogger()] + [lg for lg in map(logging.getLogger, LOGGERS) if lg.handlers]
    saved = [(lg, list(lg.handlers)) for lg in targets]
    for lg in targets:
        lg.handlers = [h for h in lg.handlers if not _replaceable(h)] + [handler]
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            yield
    finally:
        for lg, handlers in saved:
            lg.handlers = handlers


@contextmanager
def terminal_output(*, hf: bool = True) -> Iterator[None]:
    """What `quiet_libraries(False)` does: library messages as whole lines, never inside a
    bar, and bars as plain lines when stderr is not a terminal."""
    with ExitStack() as stack:
        if not stderr_is_terminal():
            stack.enter_context(_line_bars())
        stack.enter_context(_routed(hf))
        yield


@contextmanager
def quiet_libraries(enabled: bool = True, *, hf: bool = True) -> Iterator[None]:
    """While active (and `enabled`), the libraries gqakit uses print nothing but errors.

    hf=False leaves the Hugging Face libraries unimported (a verb that never loads a
    model, like `compare`, then silences only warnings and logs). Not `enabled`: their
    messages and every progress bar respect the terminal (`terminal_output`)."""
    if not enabled:
        with terminal_output(hf=hf):
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
