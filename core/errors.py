"""One exception type for every user-facing failure.

Anything raised as `GqakitError` is printed by the CLI as one line on stderr,
`gqakit: <label>: <message>`, with a non-zero exit code, never as a traceback. Raise it
for bad input and for conditions a user can fix; let real bugs propagate as ordinary
exceptions.
"""

from __future__ import annotations


def first_line(e: BaseException, limit: int | None = 300) -> str:
    """The first line of an exception's message (its type's name when it has none), for
    quoting a library's error in a one-line message."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return line if limit is None else line[:limit]


class GqakitError(Exception):
    """A failure caused by the user's input or environment, with a one-line message."""

    exit_code = 2
    label = "error"

    def one_line(self) -> str:
        """The message on one line, whatever the text it quotes (file content, library errors)."""
        return " ".join(str(self).split())


class Interrupted(GqakitError):
    """Ctrl-C: say where the run stands and how to continue it."""

    exit_code = 130
    label = "interrupted"
