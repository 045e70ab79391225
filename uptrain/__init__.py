"""gqakit.uptrain: continue pre-training a converted GQA model on 🤗 accelerate.

    from gqakit.uptrain import run_uptrain
    model_dir = run_uptrain("stories260K-g2", ["model.path=s260k-g2", "teacher.path=stories260K"])
"""

from __future__ import annotations

from typing import Any


def run_uptrain(*args: Any, **kwargs: Any) -> Any:
    """See `gqakit.uptrain.trainer.run_uptrain` (imported lazily: torch is slow to import)."""
    from gqakit.uptrain.trainer import run_uptrain as _run

    return _run(*args, **kwargs)


__all__ = ["run_uptrain"]
