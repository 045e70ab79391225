"""The reference model of a GGUF whose layers have their own KV heads (llama.cpp's per-layer
architecture, as `gqakit convert SRC.gguf OUT.gguf --kv-plan` writes it), which transformers'
GGUF loader cannot load: it parses the metadata, head counts as per-layer lists, but has no
model class for the architecture.

gqakit builds that model from the very bytes llama.cpp reads:

- the layout is the architecture table's per-layer layout: the `per_layer_kv` family of the
  GGUF families whose q/k rows llama.cpp permutes (`gguf.permute_qk`), the one layout gqakit
  writes such a GGUF from; its modeling file is gqakit's own (`convert/remote`, read as package
  data);
- config.json comes from transformers' parse of the metadata (`load_gguf_checkpoint`: sizes,
  RoPE base, norm epsilon, token ids), with each layer's query heads per KV head in the
  layout's per-layer list (the entry's `config.heads_in_group`);
- every tensor is dequantised to float32 by `gguf.quants.dequantize` (what transformers' GGUF
  loader uses), under the name gguf-py's own tensor-name table gives it, with llama.cpp's q/k
  row permutation undone using each layer's own head count.

config.json and the modeling file go to a temporary folder that is removed as soon as the
model is built; the weights never touch the disk. The tokenizer is transformers' reading of
the GGUF's vocabulary (`core.loading.load_tokenizer`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from gqakit.core.errors import GqakitError


def _open(path: Path) -> tuple[Any, str | None]:
    """gguf-py's memory-mapped reader of PATH and its `general.architecture`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields.get("general.architecture")
    return reader, arch.contents() if arch is not None else None


def per_layer_gguf(path: str | Path) -> bool:
    """Whether PATH is a .gguf whose `{arch}.attention.head_count_kv` is a per-layer array (a
    model transformers' GGUF loader cannot load; `reference_model` can). Reads only metadata."""
    path = Path(path)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return False
    from gguf import GGUFValueType

    from gqakit.core.loading import check_gguf

    check_gguf(path)  # a damaged file: gqakit's one-line error, not the reader's
    reader, arch = _open(path)
    field = reader.fields.get(f"{arch}.attention.head_count_kv")
    return field is not None and bool(field.types) and field.types[0] == GGUFValueType.ARRAY


def layout() -> Any:
    """The architecture table's entry of the per-layer layout a per-layer GGUF is read into."""
    from gqakit.core import arch

    table = arch.registry()
    targets = {s.per_layer_kv for s in table.values() if s.gguf is not None and s.gguf.permute_qk and s.per_layer_kv}
    if len(targets) != 1 or table[next(iter(targets))].remote is None:
        raise GqakitError(f"the architecture table names {len(targets)} per-layer layouts for GGUF files "
                          f"({', '.join(sorted(targets)) or 'none'}); a per-layer GGUF needs exactly one, with its "
                          "modeling file")
    return table[targets.pop()]


def _per_layer(value: Any, layers: int, what: str) -> list[int]:
    vals = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * layers
    if len(vals) != layers:
        raise GqakitError(f"the GGUF lists {len(vals)} values of {what} for {layers} layers")
    return vals


def reference_config(path: str | Path, spec: Any = None) -> dict[str, Any]:
    """config.json of the per-layer GGUF at PATH in the table's per-layer layout (`layout()`)."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    spec = spec or layout()
    path = Path(path)
    reader, arch = _open(path)
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    present = {t.name for t in reader.tensors}
    del reader

    def has(tensor: Any, suffix: str) -> bool:  # gguf-py's name of the tensor (of block 0) is in the file
        return f"{TENSOR_NAMES[tensor].format(bid=0)}.{suffix}" in present

    parsed = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    layers = int(parsed["num_hidden_layers"])
    heads = _per_layer(parsed.pop("num_attention_heads"), layers, "query heads")
    kv = _per_layer(parsed.pop("num_key_value_heads"), layers, "KV heads")
    widths = _per_layer(parsed.pop("intermediate_size"), layers, "FFN widths")
    if len(set(heads)) != 1:
        raise GqakitError(f"{path.name}: its layers have different query heads ({sorted(set(heads))}); gqakit reads "
                          "per-layer GGUF files whose layers differ in KV heads only")
    H = heads[0]
    bad = [L for L, g in enumerate(kv) if g < 1 or H % g]
    if bad:
        raise GqakitError(f"{path.name}: layer {bad[0]} has {kv[bad[0]]} KV heads, which do not divide its {H} query "
                          "heads (a layer without attention is not read)")
    list_key, _, inner = spec.config.heads_in_group.partition("[].")
    blocks = []
    for L in range(layers):
        entry: dict[str, Any] = {"attention": {"no_op": False, "replace_with_linear": False},
                                 "ffn": {"intermediate_size": widths[L], "no_op": False, "replace_with_linear": False}}
        *parents, leaf = inner.split(".")
        node = entry
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = H // kv[L]
        blocks.append(entry)
    hidden = int(parsed[spec.config.hidden_size])
    module = spec.remote.module or f"gqakit_modeling_{spec.family}"
    for k in ("model_type", "_model_name_or_path", "architectures", "auto_map"):
        parsed.pop(k, None)
    return {**parsed, "model_type": spec.model_types[0], "architectures": [spec.architectures[0]],
            "auto_map": {"AutoConfig": f"{module}.{spec.remote.config_class}",
                         "AutoModelForCausalLM": f"{module}.{spec.remote.model_class}"},
            spec.config.num_heads: H, "num_key_value_heads": max(kv), "intermediate_size": max(widths),
            spec.config.head_dim: int(key_length.contents()) if key_length is not None else hidden // H,
            list_key: blocks,
            "tie_word_embeddings": not has(MODEL_TENSOR.OUTPUT, "weight"),  # llama.cpp writes no tied LM head
            "qkv_bias": has(MODEL_TENSOR.ATTN_Q, "bias"), "attention_bias": has(MODEL_TENSOR.ATTN_OUT, "bias"),
            "dtype": "float32"}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for N_HEAD heads (transformers' GGUF loader's
    reverse of it: within each head, rows h, j, i back to h, i, j)."""
    d2 = w.shape[0] // n_head // 2
    return w.reshape(n_head, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_map(path: str | Path, model: Any) -> dict[str, Any]:
    """MODEL's state-dict name -> gguf-py's record (type, shape, mapped bytes) of the tensor of
    the GGUF at PATH that holds it, by gguf-py's own name table; a tied LM head is left out.
    Every GGUF tensor must find a place."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    path = Path(path)
    reader, arch = _open(path)
    key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if key is None:
        raise GqakitError(f"{path.name}: gguf-py has no tensor-name table for the {arch!r} GGUF architecture")
    table = get_tensor_name_map(key, int(model.config.num_hidden_layers))
    tensors = {t.name: t for t in reader.tensors}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out = {}
    for name in model.state_dict(keep_vars=True):
        base, _, suffix = name.rpartition(".")
        g = table.get_name(base) if suffix in ("weight", "bias") else None
        t = tensors.get(f"{g}.{suffix}") if g is not None else None
        if t is None:
            if tied and name == "lm_head.weight":
                continue
            raise GqakitError(f"{path.name} has no tensor for {name} (gguf-py's name: {g}.{suffix})")
        out[name] = t
    left = sorted(set(tensors) - {t.name for t in out.values()})
    if left:
        raise GqakitError(f"{path.name}: tensor {left[0]} has no place in the {type(model).__name__} layout")
    return out


def reference_weights(path: str | Path, model: Any, spec: Any = None) -> dict[str, Any]:
    """Every tensor of the per-layer GGUF at PATH under MODEL's state-dict name, float32, q/k rows
    in transformers' order (each layer's k with its own KV heads). The tied LM head is left out."""
    import torch
    from gguf.quants import dequantize

    from gqakit.core.loaded import loaded_shape

    spec = spec or layout()
    shape = loaded_shape(model.config)
    kv = shape.kv_heads_per_layer or [shape.num_kv_heads] * shape.num_layers
    at = spec.attention
    heads = {}
    for L in range(shape.num_layers):
        prefix = at.prefix.format(layer=L)
        for suffix in ("weight", "bias"):
            heads[f"{prefix}{at.q}.{suffix}"] = shape.num_heads
            heads[f"{prefix}{at.k}.{suffix}"] = int(kv[L])
    params = model.state_dict(keep_vars=True)
    out = {}
    for name, t in tensor_map(path, model).items():
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(tuple(params[name].shape))
        if name in heads:  # the layout's GGUF families are those whose q/k rows llama.cpp permutes
            w = _unpermute(w, heads[name])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # a copy: never the mapped file
    return out


def reference_model(path: str | Path, *, dtype: Any = None, device: Any = "cpu") -> Any:
    """The per-layer GGUF at PATH as a transformers model of the table's per-layer layout, in eval
    mode: what llama.cpp computes, in float32 (or DTYPE) on DEVICE."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from gqakit.core.loading import check_gguf, load_config
    from gqakit.core.trust import SHIPPED_DIR

    path = Path(path)
    check_gguf(path)
    spec = layout()
    cfg = reference_config(path, spec)
    module = spec.remote.module or f"gqakit_modeling_{spec.family}"
    tmp = Path(tempfile.mkdtemp(prefix="gqakit-gguf-reference-"))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        shutil.copyfile(SHIPPED_DIR / f"{module}.py", tmp / f"{module}.py")
        config = load_config(tmp)  # gqakit's own modeling file: trusted as in any converted folder
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    weights = reference_weights(path, model, spec)
    model.load_state_dict(weights, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    model.config.name_or_path = str(path)
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise GqakitError(f"{path.name}: no weights for {meta[0]}")
    return model.to(dtype=dtype or torch.float32, device=device).eval()


__all__ = ["layout", "per_layer_gguf", "reference_config", "reference_model",
           "reference_weights", "tensor_map"]
