"""Opening a source checkpoint: a Hugging Face model folder, or a .gguf file that
transformers dequantises to float (the tensors then stream as usual)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from gqakit.convert.io import DictSource, Source, open_source
from gqakit.core.errors import GqakitError
from gqakit.core.loading import read_config_json


@dataclass
class Opened:
    folder: Path          # where config/tokenizer files come from
    gguf: str | None
    config: dict[str, Any]
    source: Source


def open_checkpoint(src: str | Path, *, progress: bool = True) -> Opened:
    src = Path(src).expanduser()
    if not src.exists():
        raise GqakitError(f"source not found: {src}")
    if src.is_file() and src.suffix == ".gguf":
        return _open_gguf(src, progress=progress)
    if not src.is_dir():
        raise GqakitError(f"source {src} is neither a model folder nor a .gguf file")
    if not any(src.iterdir()):
        raise GqakitError(f"source folder {src} is empty")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise GqakitError(f"no config.json in {src}; is it a Hugging Face model folder?")
    config = read_config_json(src)
    return Opened(src, None, config, open_source(src))


def _open_gguf(path: Path, *, progress: bool = True) -> Opened:
    """GGUF input: transformers dequantizes it to float; the tensors then stream as usual."""
    from gqakit.core.loading import load_causal_lm

    from gqakit.core.quiet import quiet_libraries

    if progress:
        tqdm.write(f"reading {path.name} (GGUF, dequantized by transformers)", file=sys.stderr)
    with quiet_libraries(not progress):
        model = load_causal_lm(path)
    config = model.config.to_dict()
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    config.pop("_model_name_or_path", None)
    # the weights are dequantized floats now: a GGUF quantization_config would make
    # transformers treat the output as quantized (and refuse to save it after training)
    config.pop("quantization_config", None)
    config["dtype"] = str(next(iter(model.state_dict().values())).dtype).replace("torch.", "")
    sd = model.state_dict()
    if config.get("tie_word_embeddings") and "lm_head.weight" in sd:
        del sd["lm_head.weight"]  # tied: stored once, as the embedding
    return Opened(path.parent, path.name, config, DictSource(dict(sd), [path]))


def source_path(opened: Opened) -> Path:
    """The file or folder the checkpoint was opened from (what transformers loads)."""
    return Path(opened.folder) / opened.gguf if opened.gguf else Path(opened.folder)
