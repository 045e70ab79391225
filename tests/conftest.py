from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # pytest -n N: the cores shared out, children included
    _THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    torch.set_num_threads(min(torch.get_num_threads(), _THREADS))

from tiny_models import tiny_model  # noqa: E402,F401  (the pico-model fixture)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GQAKIT_SHARED", REPO.parent / "shared"))


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
