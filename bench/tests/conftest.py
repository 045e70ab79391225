"""Fixtures of the benchmark scripts' tests (pico models from tests/tiny_models.py)."""

from __future__ import annotations

import os
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import tiny_model  # noqa: E402,F401  (the pico-model fixture; tests/ is on pytest's pythonpath)


