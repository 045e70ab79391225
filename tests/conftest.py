from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GQAKIT_SHARED", REPO.parent / "shared"))


@pytest.fixture
def tiny_model(tmp_path: Path):
    """Factory: tiny_model("llama", num_key_value_heads=4) -> folder of a saved pico model."""
    counter = iter(range(1000))

    def make(family: str, **overrides) -> Path:
        return build(family, tmp_path / f"{family}-{next(counter)}", **overrides)

    return make


@pytest.fixture
def one_thread():
    """Pico models run faster on one thread than on two contended ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def shared() -> Path:
    """../shared (real model and data); tests using it skip when it is absent."""
    if not (SHARED / "models" / "stories260K" / "config.json").is_file():
        pytest.skip(f"../shared not found at {SHARED}")
    return SHARED


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
