"""A model's files checked against each other before anything loads them.

Every verb that reads a model (`inspect`, `convert`, `eval`, `uptrain`, `demo`) passes its
folder or .gguf file through here first, so a hostile or careless file is one line naming
the file and the field, never a crash, a hang or a model with random weights:

- a model folder is read only inside itself: an index may name only shards inside the
  folder (a symlink there is followed, as in the Hugging Face cache);
- every safetensors file is whole (its header against its size);
- a `pytorch_model*.bin` loads with `weights_only=True` (no pickle can run code);
- `model_type` belongs to the family that `architectures` names;
- the config's geometry (layers, query and KV heads, head_dim, hidden size) matches the
  attention weights' shapes, every layer the config names has them, and no layer beyond;
- a GGUF file's metadata (block count, head counts, context length) is positive and
  matches its tensors.

The safetensors and GGUF checks read headers only: nothing heavy is imported for them.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError, first_line

ST_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"

# A model folder's side files: the tokenizer (every format: tokenizer.json, a sentencepiece
# `tokenizer.model`, vocab/merges, tiktoken), the generation settings, and an audio model's
# feature extractor / processor settings and text normalizer. Every output model folder
# carries them verbatim from the folder it was made from (convert from SRC, uptrain from the
# converted model).
SIDE_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt|"
    r".*\.tiktoken|spiece\.model|sentencepiece.*\.model|chat_template\.(jinja|json)|generation_config\.json|"
    r"preprocessor_config\.json|processor_config\.json|normalizer\.json)$"
)


def side_files(folder: Path) -> list[Path]:
    """The tokenizer and generation files of a model folder (`SIDE_FILES`), sorted by name."""
    return [p for p in sorted(Path(folder).iterdir()) if p.is_file() and SIDE_FILES.match(p.name)]


def read_st_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file's size.

    Raises ValueError for a truncated or malformed file (OSError if unreadable)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("file shorter than its header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError("header larger than the file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, IndexError, ValueError):
        raise ValueError("header lacks data_offsets") from None
    if 8 + n + end > size:
        raise ValueError(f"file is {size} bytes but its header needs {8 + n + end}")
    header["__data_start__"] = 8 + n
    return header


def shard_path(folder: Path, rel: Any, index_name: str) -> Path:
    """FOLDER/REL for a shard an index names; REL must stay inside FOLDER and exist."""
    folder = Path(folder)
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] == "..":
        raise GqakitError(f"{folder / index_name}: shard path {rel!r} escapes {folder}; "
                          f"a model folder is read only inside itself")
    path = folder / rel
    if not path.is_file():
        raise GqakitError(f"index {index_name} names shard {rel!r}, which is missing from {folder}")
    return path


def index_map(folder: Path, index_name: str) -> dict[str, Path]:
    """Tensor name -> shard file of an index in FOLDER, every shard checked by `shard_path`."""
    p = Path(folder) / index_name
    try:
        weight_map = json.loads(p.read_bytes().decode("utf-8"))["weight_map"]
        items = list(weight_map.items())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise GqakitError(f"{p} is not a valid index: {e}") from None
    paths: dict[Any, Path] = {}
    out: dict[str, Path] = {}
    for name, rel in items:
        if not isinstance(rel, str) or rel not in paths:
            paths[rel if isinstance(rel, str) else None] = shard_path(folder, rel, index_name)
        out[name] = paths[rel]
    return out


def load_bin(path: Path) -> dict[str, Any]:
    """A `pytorch_model*.bin` state dict, loaded with `weights_only=True` (memory-mapped when
    it is a zip file): an unsafe pickle, a damaged file or other content is one line."""
    import pickle
    import zipfile

    import torch

    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as e:
        raise GqakitError(f"{path.name} needs unsafe unpickling (weights_only=True refused it: "
                          f"{first_line(e, 160)}); convert it to safetensors first") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
        raise GqakitError(f"cannot read {path.name}: truncated or corrupt ({first_line(e, 160)})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise GqakitError(f"{path.name} is not a state dict of tensors")
    return sd


def weight_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], Path]] | None:
    """Tensor name -> (shape, file) of the weights a loader would read from FOLDER (the
    safetensors files, or else the .bin files); None when FOLDER holds neither. Every file
    is checked on the way: whole, inside the folder, no unsafe pickle."""
    folder = Path(folder)
    if (folder / ST_INDEX).is_file():
        where = index_map(folder, ST_INDEX)
        files = list(dict.fromkeys(where.values()))
    else:
        files = sorted(folder.glob("*.safetensors"))
        where = None
    if files:
        shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
        for f in files:
            try:
                header = read_st_header(f)
            except (OSError, ValueError) as e:
                raise GqakitError(f"cannot read {f}: truncated or corrupt safetensors file ({e})") from None
            for name, entry in header.items():
                if name.startswith("__") or where is not None and where.get(name) != f:
                    continue
                shape = entry.get("shape") if isinstance(entry, dict) else None
                if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                    raise GqakitError(f"cannot read {f}: truncated or corrupt safetensors file (tensor {name} "
                                      f"has no valid shape)")
                shapes[name] = (tuple(shape), f)
        return shapes
    if (folder / BIN_INDEX).is_file():
        bins = list(dict.fromkeys(index_map(folder, BIN_INDEX).values()))
    else:
        bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        return None
    return {name: (tuple(t.shape), f) for f in bins for name, t in load_bin(f).items()}


# ----------------------------------------------------------------------------- config against weights

def check_model_type(config: Mapping[str, Any], where: Path) -> None:
    """`model_type` must belong to the family `architectures` names: a loader builds the
    model from `model_type`, so a mismatch would load no weight at all."""
    spec = archmod.find(config)
    mtype = config.get("model_type")
    arch = (config.get("architectures") or [None])[0]
    if spec is None or mtype is None or arch is None or arch not in spec.architectures:
        return
    if mtype not in spec.model_types and mtype != f"gqakit_{spec.family}":
        raise GqakitError(f"{where}: model_type {mtype!r} does not match architectures {arch!r} "
                          f"(a {spec.family} model has model_type {spec.model_types[0]!r})")


def expected_attention(spec: archmod.ArchSpec, shape: archmod.Shape, layer: int,
                       site: str = "self") -> dict[str, tuple[int, ...]]:
    """The shapes a layer's attention weights (and biases, when present) must have; `site`:
    "self", or an encoder-decoder's "cross" or "encoder" (then `shape` is the encoder's)."""
    a = spec.attention_at(site)
    H, KV, D, hid = shape.num_heads, shape.kv_heads_of(layer), shape.head_dim, shape.hidden_size
    p = a.prefix.format(layer=layer)
    want: dict[str, tuple[int, ...]] = {}
    if a.layout == "separate":
        for part, rows in ((a.q, H * D), (a.k, KV * D), (a.v, KV * D)):
            want[f"{p}{part}.weight"] = (rows, hid)
            want[f"{p}{part}.bias"] = (rows,)
    else:
        rows = (H + 2 * KV) * D
        want[f"{p}{a.qkv}.weight"] = (hid, rows) if a.transposed else (rows, hid)
        want[f"{p}{a.qkv}.bias"] = (rows,)
    want[f"{p}{a.o}.weight"] = (H * D, hid) if a.transposed else (hid, H * D)
    return want


def _lookup(shapes: Mapping[str, Any], name: str) -> str | None:
    """NAME, or NAME without its first component (weights saved from the base model)."""
    if name in shapes:
        return name
    short = name.split(".", 1)[-1]
    return short if short in shapes else None


def check_geometry(config: Mapping[str, Any], shapes: Mapping[str, tuple[tuple[int, ...], Path]],
                   where: Path) -> None:
    """The config's geometry against the weights' shapes (families of the architecture
    table; a family gqakit does not know is left to the loader's own check of every name):
    every layer the config names is there, none beyond, each holds what the others hold,
    and each layer's attention weights have the shapes the head counts and sizes imply.
    An encoder-decoder's decoder (self- and cross-attention) and encoder are checked alike."""
    spec = archmod.find(config)
    if spec is None:
        return
    shape = archmod.shape_of(spec, config)
    keys = spec.config
    fields = ", ".join(f"{k}={config[k]}" for k in dict.fromkeys(
        (keys.num_heads, keys.num_kv_heads or "num_key_value_heads", keys.head_dim, keys.hidden_size))
        if k and config.get(k) is not None)
    _check_stack(spec, spec.block, keys.num_layers, shape, ("self", "cross") if spec.cross_attention else ("self",),
                 shapes, where, fields)
    if spec.encoder is not None:
        enc = spec.encoder
        fields = ", ".join(f"{k}={config[k]}" for k in dict.fromkeys(
            (enc.num_heads, enc.num_kv_heads, keys.head_dim, keys.hidden_size)) if k and config.get(k) is not None)
        _check_stack(spec, enc.block, enc.num_layers, archmod.encoder_shape_of(spec, config), ("encoder",),
                     shapes, where, fields)


def _check_stack(spec: archmod.ArchSpec, block_path: str, layers_key: str, shape: archmod.Shape,
                 sites: tuple[str, ...], shapes: Mapping[str, tuple[tuple[int, ...], Path]], where: Path,
                 fields: str) -> None:
    """`check_geometry` for one stack of blocks (`block_path` with {layer}) and its attention sites."""
    files = ", ".join(sorted({f.name for _, f in shapes.values()})) or "the folder"
    pattern = re.escape(block_path).replace(re.escape("{layer}"), r"(\d+)")
    block = re.compile(r"^" + pattern + r"\.|^" + pattern.split(r"\.", 1)[-1] + r"\.")
    per_layer: dict[int, dict[str, str]] = {}
    for name in shapes:
        m = block.match(name)
        if m:
            layer = int(m.group(1) if m.group(1) is not None else m.group(2))
            per_layer.setdefault(layer, {})[name[m.end():]] = name
    beyond = sorted(i for i in per_layer if i >= shape.num_layers)
    if beyond:
        name = sorted(per_layer[beyond[0]].values())[0]
        raise GqakitError(f"{where}: {layers_key}={shape.num_layers}, but {shapes[name][1].name} holds "
                          f"{name}, a weight of layer {beyond[0]}")
    # here every layer held is below num_layers, so this loop is as long as the weights
    missing = next((i for i in range(len(per_layer) + 1) if i < shape.num_layers and i not in per_layer), None)
    if missing is not None:
        name = next(iter(expected_attention(spec, shape, missing, sites[0])))
        raise GqakitError(f"{where}: {layers_key}={shape.num_layers}, but tensor {name} (layer {missing}) "
                          f"is not present in {files}")
    everything = set().union(*per_layer.values())
    for layer in range(shape.num_layers):
        for site in sites:
            for name, want in expected_attention(spec, shape, layer, site).items():
                found = _lookup(shapes, name)
                if found is None:
                    if name.endswith(".weight"):
                        raise GqakitError(f"tensor {name} required by the {spec.family} layout but not present "
                                          f"in {files}")
                    continue
                got, f = shapes[found]
                if tuple(got) != want:
                    raise GqakitError(f"{where}: {fields} disagree with the weights: {found} in {f.name} has shape "
                                      f"{list(got)}, where the config implies {list(want)}")
        # one layer's MLP or norm left out, or one layer with a tensor the others lack (the
        # family's `first_block_only` tensors aside)
        lacking = sorted(everything - set(per_layer[layer]) - (set(spec.first_block_only) if layer else set()))
        extra = sorted(set(spec.first_block_only) & set(per_layer[layer])) if layer else []
        if extra:
            raise GqakitError(f"{files}: the layers hold different tensors: {per_layer[layer][extra[0]]} is a "
                              f"tensor only {block_path.format(layer=0)} holds in a {spec.family} model")
        if lacking:
            other = next(i for i in sorted(per_layer) if lacking[0] in per_layer[i])
            raise GqakitError(f"{files}: the layers hold different tensors: {per_layer[other][lacking[0]]} has no "
                              f"counterpart {block_path.format(layer=layer)}.{lacking[0]}")


def check_folder(folder: Path, config: Mapping[str, Any]) -> None:
    """Everything above for a model folder whose config.json has been read into CONFIG."""
    where = Path(folder) / "config.json"
    check_model_type(config, where)
    shapes = weight_shapes(Path(folder))
    if shapes is not None:
        check_geometry(config, shapes, where)


# ----------------------------------------------------------------------------- GGUF metadata

def _field(reader: Any, key: str) -> list[int] | None:
    """An integer field (or array of integers) of a GGUF file as a list; None when absent."""
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        v = f.contents()
    except Exception:  # gguf raises assorted errors on odd types
        return []
    vals = v if isinstance(v, list) else [v]
    return [x for x in vals if isinstance(x, int) and not isinstance(x, bool)] if len(vals) else []


def check_gguf_metadata(reader: Any, path: Path) -> None:
    """A GGUF file's architecture metadata against its tensors (READER: a `gguf.GGUFReader`)."""
    arch_field = reader.fields.get("general.architecture")
    try:
        arch = arch_field.contents() if arch_field is not None else None
    except Exception:
        arch = None
    if not isinstance(arch, str):
        raise GqakitError(f"{path}: metadata general.architecture is missing")
    name = str(path)
    values: dict[str, list[int] | None] = {}
    for key in ("block_count", "context_length", "embedding_length", "attention.head_count",
                "attention.head_count_kv", "attention.key_length", "attention.value_length"):
        v = values[key] = _field(reader, f"{arch}.{key}")
        if v is not None and (not v or any(x <= 0 for x in v)):
            raise GqakitError(f"{name}: metadata {arch}.{key} must be a positive integer, got "
                              f"{reader.fields[f'{arch}.{key}'].contents()!r}")
    if values["block_count"] is None:
        return  # no transformer blocks described (another kind of model): the loader's to judge
    blocks = values["block_count"][0]
    tensors = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    held = sorted({int(m.group(1)) for n in tensors if (m := re.match(r"blk\.(\d+)\.", n))})
    if held and held != list(range(blocks)):
        raise GqakitError(f"{name}: metadata {arch}.block_count is {blocks}, but the file holds tensors for blocks "
                          f"{held[0]}..{held[-1]} ({len(held)} blocks)")
    if values["attention.head_count"] is None or values["embedding_length"] is None:
        return
    hid = values["embedding_length"][0]
    heads_all = values["attention.head_count"]
    kv_all = values["attention.head_count_kv"] or heads_all
    for layer in held:  # = range(block_count) here, or nothing
        H = heads_all[layer] if len(heads_all) == blocks else heads_all[0]
        KV = kv_all[layer] if len(kv_all) == blocks else kv_all[0]
        if H % KV:
            raise GqakitError(f"{name}: metadata {arch}.attention.head_count {H} is not a multiple of "
                              f"{arch}.attention.head_count_kv {KV}")
        dk = (values["attention.key_length"] or [hid // H])[0]
        dv = (values["attention.value_length"] or [dk])[0]
        want = {"attn_q": H * dk, "attn_k": KV * dk, "attn_v": KV * dv, "attn_qkv": H * dk + KV * (dk + dv)}
        for part, rows in want.items():
            t = tensors.get(f"blk.{layer}.{part}.weight")
            if t is not None and len(t) == 2 and t[1] != rows:  # GGUF shapes are [in, out]
                raise GqakitError(f"{name}: metadata {arch}.attention.head_count={H}, head_count_kv={KV} "
                                  f"(head size {dk}) disagree with tensor blk.{layer}.{part}.weight of shape "
                                  f"{t[::-1]}, which needs {rows} rows")


def check_loaded(info: Mapping[str, Any], path: Path, model_class: str) -> None:
    """After a loader built the model: a weight it needs that the files lack (it would
    run with random values) or a weight in the files it has no place for is an error."""
    for key, what in (("missing_keys", "lack {name}, which {cls} needs"),
                      ("unexpected_keys", "hold {name}, which {cls} has no place for")):
        names = sorted(info.get(key) or [])
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise GqakitError(f"{path}: the weights {what.format(name=names[0], cls=model_class)}{more}; "
                              f"does config.json (model_type, architectures, sizes) describe these weights?")
