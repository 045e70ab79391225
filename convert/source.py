"""Opening a source model: a Hugging Face model folder, a .gguf file, or a Hub id
`org/name[@revision]` in the Hugging Face cache (`core/hub.py`; a local path wins).

A .gguf file is memory-mapped and read one tensor at a time (`gguf_in.stream_gguf`), so
its tensors stream like a folder's. Only an architecture with no tensor-name map (neither
gqakit's nor transformers') has transformers dequantize the whole model into memory
first; that is said in one line, with the memory it takes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from gqakit.convert.io import DictSource, Opened, open_source
from gqakit.core.hub import resolve_model_ref
from gqakit.core.loading import check_source_path, read_config_json
from gqakit.core.run import show_bars

__all__ = ["Opened", "open_model", "source_path"]


def open_model(src: str | Path, *, progress: bool | None = None) -> Opened:
    """The source model SRC, opened; what it says while opening a .gguf file (and the libraries'
    bars) as the run context says, or as `progress` when given."""
    progress = show_bars(progress)
    src = resolve_model_ref(src).path
    check_source_path(src)
    if src.is_file():
        return _open_gguf(src, progress=progress)
    config = read_config_json(src)
    return Opened(src, None, config, open_source(src))


def _open_gguf(path: Path, *, progress: bool = True) -> Opened:
    """GGUF input, memory-mapped and dequantised tensor by tensor; for an architecture with
    no name map, transformers dequantises the whole model first."""
    from gqakit.convert.gguf_in import NoStream, stream_gguf
    from gqakit.core.quiet import quiet_libraries

    with quiet_libraries(not progress):
        got = stream_gguf(path)
    if not isinstance(got, NoStream):
        if progress:
            tqdm.write(f"reading {path.name} (GGUF {got.arch}, memory-mapped: one tensor dequantised at a time)",
                       file=sys.stderr)
        return got.opened
    if progress:
        tqdm.write(f"{path.name}: {got.reason}; transformers dequantises the whole model into memory first "
                   f"(about {got.float32_bytes / 2**30:.1f} GiB)", file=sys.stderr)
    return _load_whole_gguf(path, progress=progress)


def _load_whole_gguf(path: Path, *, progress: bool = True) -> Opened:
    """transformers dequantises every tensor of PATH into memory; the tensors then stream as usual."""
    from gqakit.core.loading import load_causal_lm
    from gqakit.core.quiet import quiet_libraries

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
    """The file or folder the source model was opened from (what transformers loads)."""
    return Path(opened.folder) / opened.gguf if opened.gguf else Path(opened.folder)
