"""Load models and tokenizers from a local folder, a .gguf file or a Hub id in the cache, offline.

A model argument that is no local path but is spelled `org/name[@revision]` is that
repository's snapshot in the Hugging Face cache (`core/hub.py`); a local path always wins.

Folders written by `gqakit convert` for families without stock GQA support carry a
modeling file `gqakit_modeling_<family>.py` and an `auto_map` in config.json. Such a file
runs without asking only when it is byte-identical to the one this version of gqakit
ships; any other code from a model folder runs only with --trust-remote-code
(`core/trust.py` decides, for every loader here).

Every file is checked before transformers sees it (config.json, safetensors headers and
sizes, GGUF structure), so a damaged model is one line naming the file, never a
traceback from deep inside a loader. The checks import nothing heavy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from pathlib import Path
from typing import Any

from gqakit.core import trust
from gqakit.core.errors import GqakitError, first_line
from gqakit.core.hub import resolve_model_ref
from gqakit.core.modelfiles import check_folder, check_gguf_metadata, check_loaded

# Nothing in gqakit reaches the Hugging Face Hub unless the user sets HF_HUB_OFFLINE=0
# (then a Hub id missing from the cache is downloaded: `core/hub.py`).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

CONVERT_SETTINGS = "gqakit_convert.json"   # written by `gqakit convert`
UPTRAIN_SETTINGS = "gqakit_uptrain.yaml"   # written by `gqakit uptrain`
REMOTE_PREFIX = trust.REMOTE_PREFIX
ST_INDEX = "model.safetensors.index.json"

# Sizes a config may leave out or set to null, but never to zero, a negative or a string.
POSITIVE_KEYS = ("num_attention_heads", "num_key_value_heads", "hidden_size", "num_hidden_layers",
                 "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim",
                 "n_head", "n_layer", "n_embd", "n_positions", "n_ctx")


def read_config_json(folder: str | Path) -> dict[str, Any]:
    """config.json of FOLDER as a dict, or one GqakitError saying what is wrong with it."""
    p = Path(folder) / "config.json"
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise GqakitError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise GqakitError(f"{p} is not valid JSON: not UTF-8 text (a damaged or binary file)") from None
    except json.JSONDecodeError as e:
        raise GqakitError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise GqakitError(f"{p} must hold a JSON object of settings, not a {type(cfg).__name__}")
    for where, sub in (("", cfg), ("text_config.", cfg.get("text_config"))):
        if not isinstance(sub, dict):
            continue
        for key in POSITIVE_KEYS:
            v = sub.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise GqakitError(f"{p}: {where}{key} must be a positive integer, got {v!r}")
    return cfg


def check_source_path(src: Path) -> None:
    """SRC is an existing .gguf file or a non-empty folder holding a config.json; else one
    GqakitError saying which it is not (torch-free: the CLI asks before the heavy imports)."""
    if not src.exists():
        raise GqakitError(f"source not found: {src}")
    if src.is_file() and src.suffix == ".gguf":
        return
    if not src.is_dir():
        raise GqakitError(f"source {src} is neither a model folder nor a .gguf file")
    if not any(src.iterdir()):
        raise GqakitError(f"source folder {src} is empty")
    if not (src / "config.json").is_file():
        raise GqakitError(f"no config.json in {src}; is it a Hugging Face model folder?")


def check_weights(folder: Path) -> None:
    """The weights of FOLDER are whole, inside it, and agree with its config.json; else one
    line naming the file and the field (`core/modelfiles.py`)."""
    folder = Path(folder)
    config = read_config_json(folder) if (folder / "config.json").is_file() else {}
    check_folder(folder, config)


@lru_cache(maxsize=16)
def _check_gguf(path: str, size: int, mtime: int) -> None:
    try:
        from gguf import GGUFReader
    except ImportError:  # a dependency of gqakit, but an environment can lack it (a GPU image did)
        raise GqakitError(f"cannot read {path}: reading GGUF needs the `gguf` package (pip install gguf)") from None
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, struct.error, numpy errors, ... on damage
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise GqakitError(f"cannot read {path}: truncated or corrupt GGUF file ({first})") from None
    check_gguf_metadata(reader, Path(path))


def check_gguf(path: Path) -> None:
    st = Path(path).stat()
    _check_gguf(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def split_source(path: str | Path) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for a folder, a .gguf path or a Hub id in the cache;
    config.json is checked."""
    p = resolve_model_ref(path).path
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
    read_config_json(p)
    trust.check_folder(p)  # code that claims to be gqakit's and is not: refused before anything loads
    return p, None


def remote_code(folder: Path, gguf: str | None) -> bool:
    """`trust_remote_code` for transformers: a GGUF file carries no code; a folder's code
    runs when it is gqakit's own or the user allowed it (`core.trust.check_folder`)."""
    return False if gguf else trust.check_folder(folder)


def _refuse_code(folder: Path, e: BaseException) -> None:
    """transformers said the folder needs its own code: one line naming the file and the flag."""
    if trust.needs_code(e) and trust.code_files(folder):
        raise trust.refusal(folder) from None


def is_gqakit_output(folder: Path) -> bool:
    folder = Path(folder)
    return (folder / CONVERT_SETTINGS).is_file() or (folder / UPTRAIN_SETTINGS).is_file()


def load_config(path: str | Path, *, trust_remote_code: bool | None = None) -> Any:
    from transformers import AutoConfig

    folder, gguf = split_source(path)
    if gguf:
        check_gguf(folder / gguf)
    trc = remote_code(folder, gguf) if trust_remote_code is None else trust_remote_code
    try:
        return AutoConfig.from_pretrained(folder, gguf_file=gguf, trust_remote_code=trc)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        _refuse_code(folder, e)
        raise GqakitError(f"cannot read the model config of {path}: {first_line(e)}") from None


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
    return _load_auto("AutoModelForCausalLM", path, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                      progress=progress, **kwargs)


def load_seq2seq_lm(path: str | Path, *, dtype: Any = None, device: Any = "cpu",
                    trust_remote_code: bool | None = None, progress: bool = True, **kwargs: Any) -> Any:
    """`AutoModelForSeq2SeqLM.from_pretrained` for an encoder-decoder folder (T5, mT5, BART, and
    gqakit's GQA versions of them, whose shipped modeling files are trusted as for decoders), in eval mode;
    `AutoModelForSpeechSeq2Seq` for a stock model type transformers lists only there (audio input)."""
    return _load_auto(seq2seq_auto_class(path), path, dtype=dtype, device=device,
                      trust_remote_code=trust_remote_code, progress=progress, **kwargs)


def seq2seq_auto_class(path: str | Path) -> str:
    """The transformers Auto class that loads the encoder-decoder at PATH: `AutoModelForSeq2SeqLM`
    (text in, and every folder whose `auto_map` names it, as gqakit's converted folders do), or
    `AutoModelForSpeechSeq2Seq` for a stock model type transformers lists only as speech-to-text."""
    folder, gguf = split_source(path)
    if gguf:
        return "AutoModelForSeq2SeqLM"
    cfg = read_config_json(folder)
    if "AutoModelForSeq2SeqLM" in (cfg.get("auto_map") or {}):
        return "AutoModelForSeq2SeqLM"
    from transformers.models.auto.modeling_auto import (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)

    mtype = cfg.get("model_type")
    if mtype in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES and mtype not in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return "AutoModelForSpeechSeq2Seq"
    return "AutoModelForSeq2SeqLM"


def encoder_input(path: str | Path) -> str:
    """What the encoder of the model at PATH reads, from its architecture table entry: "features"
    (audio features, `input_features`) or "tokens" (token ids; also every model not in the table)."""
    from gqakit.core import arch

    folder, gguf = split_source(path)
    if gguf:
        return "tokens"
    spec = arch.find(read_config_json(folder))
    return "features" if spec is not None and spec.encoder is not None and spec.encoder.features else "tokens"


def is_encoder_decoder(path: str | Path) -> bool:
    """True for an encoder-decoder model folder: `is_encoder_decoder` in its config.json, or, where
    the file does not say, a model type transformers lists as sequence-to-sequence. A .gguf is not one."""
    folder, gguf = split_source(path)
    if gguf:
        return False
    cfg = read_config_json(folder)
    if "is_encoder_decoder" in cfg:
        return cfg["is_encoder_decoder"] is True
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    return cfg.get("model_type") in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES


def _load_auto(auto_class: str, path: str | Path, *, dtype: Any, device: Any, trust_remote_code: bool | None,
               progress: bool, **kwargs: Any) -> Any:
    import torch
    import transformers
    from safetensors import SafetensorError

    folder, gguf = split_source(path)
    if gguf:
        check_gguf(folder / gguf)
    else:
        check_weights(folder)
    trc = remote_code(folder, gguf) if trust_remote_code is None else trust_remote_code
    from gqakit.core.quiet import gguf_bars_off

    try:
        with hf_bars(progress), gguf_bars_off() if gguf else nullcontext():
            model, info = getattr(transformers, auto_class).from_pretrained(
                folder, gguf_file=gguf, dtype=dtype or torch.float32, trust_remote_code=trc,
                output_loading_info=True, **kwargs
            )
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, AttributeError, SafetensorError) as e:
        _refuse_code(folder, e)
        raise GqakitError(f"cannot load the model at {path}: {first_line(e)}") from None
    check_loaded(info, Path(path), type(model).__name__)
    return model.to(device).eval()


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    folder, gguf = split_source(path)
    if gguf:
        check_gguf(folder / gguf)
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf, trust_remote_code=remote_code(folder, gguf))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        if gguf:  # an architecture transformers' GGUF config reader lacks: the vocabulary alone
            from transformers import PreTrainedTokenizerFast

            try:
                return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=gguf)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
        _refuse_code(folder, e)
        raise GqakitError(f"cannot load the tokenizer of {path}: {first_line(e)}") from None


def cache_kwarg(model: Any) -> str:
    """The name a model's forward takes its KV cache under: `cache` from transformers 5.24
    (which deprecates `past_key_values`, to be removed in 5.40), else `past_key_values`."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"
