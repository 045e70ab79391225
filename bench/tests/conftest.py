"""Fixtures of the benchmark scripts' tests (pico models from tests/tiny_models.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import build  # noqa: E402  (tests/ is on pytest's pythonpath)


@pytest.fixture
def tiny_model(tmp_path: Path):
    """Factory: tiny_model("llama", num_key_value_heads=4) -> folder of a saved pico model."""
    counter = iter(range(1000))

    def make(family: str, **overrides) -> Path:
        return build(family, tmp_path / f"{family}-{next(counter)}", **overrides)

    return make
