"""Moved to `gqakit.core.arch` (the architecture table is shared by every stage); this alias
keeps `gqakit.convert.arch` imports of code written before the move working."""

from gqakit.core.arch import *  # noqa: F401,F403
