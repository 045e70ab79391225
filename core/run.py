"""The run context: whether this run draws progress bars and whether it is quiet (`-q`).

A verb sets it once, where it starts (`running`), and the code that draws a bar or prints
a message reads it (`current`, `show_bars`) instead of receiving `progress`/`quiet` through
every call in between. A function that takes `progress=` keeps it as an override: None (its
default) means "as the run says". Outside any verb (a library call, a test) the context is
the default: bars on, not quiet. It is a context variable, so threads and asyncio tasks
started inside a run see that run's context.
"""

from __future__ import annotations
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class RunContext:
    progress: bool = True   # draw progress bars (never when quiet)
    quiet: bool = False     # nothing on stderr but errors


_CURRENT: ContextVar[RunContext] = ContextVar("gqakit_run", default=RunContext())


def current() -> RunContext:
    """The context of the run in progress (the default outside one)."""
    return _CURRENT.get()


@contextmanager
def running(*, progress: bool = True, quiet: bool = False) -> Iterator[RunContext]:
    """The context of one run, for as long as the block lasts (a quiet run draws no bars)."""
    ctx = RunContext(progress=progress and not quiet, quiet=quiet)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


@contextmanager
def progress_as(progress: bool | None) -> Iterator[RunContext]:
    """The run's context with `progress` in place of its own while the block lasts; None
    leaves it as it is. A public function's `progress=` argument goes through here, so what it
    calls reads the context (a quiet run stays without bars)."""
    if progress is None:
        yield current()
        return
    ctx = current()
    with running(progress=progress, quiet=ctx.quiet) as inner:
        yield inner


def show_bars(progress: bool | None = None) -> bool:
    """Whether to draw a bar: `progress` when the caller gives one, else the run's setting."""
    return current().progress if progress is None else progress
