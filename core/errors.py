"""One exception type for every user-facing failure.

Anything raised as `GqakitError` is printed by the CLI as one line on stderr with a
non-zero exit code, never as a traceback. Raise it for bad input and for conditions a
user can fix; let real bugs propagate as ordinary exceptions.
"""

from __future__ import annotations


class GqakitError(Exception):
    """A failure caused by the user's input or environment, with a one-line message."""

    exit_code = 2
