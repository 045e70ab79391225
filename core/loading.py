"""Load models and tokenizers from a local folder or a .gguf file, offline.

Folders written by `gqakit convert` for families without stock GQA support carry a
modeling file `gqakit_modeling_<family>.py` and an `auto_map` in config.json. Those are
loaded with `trust_remote_code=True` automatically, because the code is gqakit's own;
any other remote code needs the caller's explicit `trust_remote_code=True`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError

# Nothing in gqakit may reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

CONVERT_SETTINGS = "gqakit_convert.json"   # written by `gqakit convert`
UPTRAIN_SETTINGS = "gqakit_uptrain.yaml"   # written by `gqakit uptrain`
REMOTE_PREFIX = "gqakit_modeling_"


def split_source(path: str | Path) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for a folder or a .gguf path."""
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise GqakitError(f"GGUF file not found: {p}")
        return p.parent, p.name
    if not p.exists():
        raise GqakitError(f"model not found: {p}")
    if not p.is_dir():
        raise GqakitError(f"{p} is neither a model folder nor a .gguf file")
    if not (p / "config.json").is_file():
        raise GqakitError(f"{p} has no config.json; is it a Hugging Face model folder?")
    return p, None


def is_gqakit_remote(folder: Path) -> bool:
    """True when config.json's auto_map points only at gqakit's own modeling file."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    amap = cfg.get("auto_map") or {}
    mods = {v.split(".")[0] for v in amap.values() if isinstance(v, str)}
    return bool(mods) and all(m.startswith(REMOTE_PREFIX) and (Path(folder) / f"{m}.py").is_file() for m in mods)


def is_gqakit_output(folder: Path) -> bool:
    folder = Path(folder)
    return (folder / CONVERT_SETTINGS).is_file() or (folder / UPTRAIN_SETTINGS).is_file()


def load_config(path: str | Path, *, trust_remote_code: bool | None = None) -> Any:
    from transformers import AutoConfig

    folder, gguf = split_source(path)
    trc = is_gqakit_remote(folder) if trust_remote_code is None else trust_remote_code
    try:
        return AutoConfig.from_pretrained(folder, gguf_file=gguf, trust_remote_code=trc)
    except (OSError, ValueError, KeyError) as e:
        raise GqakitError(f"cannot read the model config of {path}: {str(e).splitlines()[0]}") from None


@contextmanager
def hf_bars(enabled: bool) -> Iterator[None]:
    """transformers' own progress bars ("Loading weights") off for a block unless `enabled`
    (enabled leaves them as they are: a global -q still wins)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def load_causal_lm(path: str | Path, *, dtype: Any = None, device: Any = "cpu",
                   trust_remote_code: bool | None = None, progress: bool = True, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained` for a folder or a .gguf file, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, gguf = split_source(path)
    trc = is_gqakit_remote(folder) if trust_remote_code is None else trust_remote_code
    try:
        with hf_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=gguf, dtype=dtype or torch.float32, trust_remote_code=trc, **kwargs
            )
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise GqakitError(f"cannot load the model at {path}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval()


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    folder, gguf = split_source(path)
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    except (OSError, ValueError, KeyError) as e:
        raise GqakitError(f"cannot load the tokenizer of {path}: {str(e).splitlines()[0]}") from None
