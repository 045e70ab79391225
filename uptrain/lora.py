"""LoRA uptraining through Hugging Face `peft`: low-rank adapters on the converted projections.

With `train.lora` set, the converted model is wrapped by `peft` before training: every
target projection gets a pair of low-rank matrices (rank `r`, scale `alpha / r`), only those
are trained and only they reach the optimizer, and the rest of the network stays frozen in
the compute dtype (bf16 on a GPU), so no fp32 master copy, gradient or Adam state is held
for it. Checkpoints hold the wrapped model as it is, so resuming is as exact as without LoRA.

At export the adapters are merged into their projections (`merged_state_dict`, in fp32 on
the gathered state dict, so it works the same under DDP and FSDP): OUT is a plain GQA folder
with the stock names, and it loads without peft.

The default targets are the projections the conversion changed, read from the folder's
`gqakit_convert.json` (`changed`: per grouped attention, the projections whose values the
method changed; a record written before it had that field names its method, whose `changes`
in the method table `core.methods` say the same); for an encoder-decoder, those of the
attentions it grouped, named in full layer by layer. Names follow peft's rule: a target
matches a module whose name is the target or ends with "." + target.

This module imports neither torch nor peft at import time: the config check needs neither.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gqakit.core.arch import SITE_NAMES, registry
from gqakit.core.convrecord import ConversionRecord, read_conversion_record
from gqakit.core.errors import GqakitError, first_line
from gqakit.core.loading import CONVERT_SETTINGS
from gqakit.core.methods import METHODS, changed_projections

PEFT_PREFIX = "base_model.model."  # where peft puts the wrapped model in its state dict
ADAPTER_NAME = "default"


def default_targets(src: Path) -> list[str]:
    """The attention projections the conversion of SRC changed, as peft target names."""
    record = read_conversion_record(src)
    family, method = (record.family, record.settings.method) if record is not None else (None, None)
    if family is None or method is None:
        raise GqakitError(f"train.lora.targets: {Path(src) / CONVERT_SETTINGS} does not say the family and method; "
                          "give train.lora.targets")
    spec = registry().get(family)
    if spec is None:
        raise GqakitError(f"train.lora.targets: unknown family {family!r} in {CONVERT_SETTINGS}; "
                          "give train.lora.targets")
    changed = _changed_by_site(record, spec, method)
    if spec.is_encoder_decoder:
        return _encoder_decoder_targets(spec, record, changed)
    att = spec.attention
    parent = att.prefix.rstrip(".").split(".")[-1]  # "self_attn", "attn", ...
    targets = [f"{parent}.{name}" for name in changed.get(SITE_NAMES["self"], [])]
    if not targets:
        raise GqakitError(f"train.lora.targets: {CONVERT_SETTINGS} says the conversion changed no projection; "
                          "give train.lora.targets")
    return targets


def _changed_by_site(record: ConversionRecord, spec: Any, method: str) -> dict[str, list[str]]:
    """The record's `changed` (attention name -> projections); for a record without it (or with
    a malformed one), what the method's entry in the table says it changes, in every attention."""
    if record.changed is not None:
        return record.changed
    if method not in METHODS:
        raise GqakitError(f"train.lora.targets: {CONVERT_SETTINGS} names method {method!r}, which is not in the "
                          "method table, and does not say which projections changed; give train.lora.targets")
    sites = ["self", "cross", "encoder"] if spec.is_encoder_decoder else ["self"]
    return {SITE_NAMES[s]: changed_projections(spec.attention_at(s), METHODS[method].changes) for s in sites}


def _encoder_decoder_targets(spec: Any, record: ConversionRecord, changed: dict[str, list[str]]) -> list[str]:
    """Full module names, layer by layer: the attentions the conversion grouped (the decoder's
    self- and cross-attention; the encoder's too with --group-encoder). A short suffix would
    also match the attentions it left multi-head (T5 names both stacks' `SelfAttention`)."""
    site_of = {name: site for site, name in SITE_NAMES.items()}
    chosen = []
    for name in record.grouped if record.grouped is not None else [None]:
        layers = record.encoder_num_layers if site_of.get(name) == "encoder" else record.num_layers
        if name not in site_of or layers is None:
            raise GqakitError(f"train.lora.targets: {CONVERT_SETTINGS} does not say which attentions were grouped; "
                              "give train.lora.targets")
        chosen.append((spec.attention_at(site_of[name]), layers, site_of[name]))
    return [att.prefix.format(layer=L) + name
            for att, layers, site in chosen for L in range(layers) for name in changed.get(SITE_NAMES[site], [])]


def short_targets(targets: list[str]) -> str:
    """Targets for a card or a log line: names that differ only in their layer number are written
    once, with `*` for the layer and the number of layers ("decoder.block.*.layer.0.SelfAttention.k (6 layers)")."""
    import re

    groups: dict[str, int] = {}
    for t in targets:
        key = re.sub(r"\.\d+\.", ".*.", t, count=1)
        groups[key] = groups.get(key, 0) + 1
    return ", ".join(k if n == 1 or "*" not in k else f"{k} ({n} layers)" for k, n in groups.items())


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def check_targets(model: Any, targets: list[str]) -> None:
    """Every target names at least one module of MODEL; else one line naming it."""
    names = [n for n, _ in model.named_modules()]
    for t in targets:
        if not any(_matches(n, t) for n in names):
            linear = [n for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")]
            example = f" (its projections are named like {linear[0]!r})" if linear else ""
            raise GqakitError(f"train.lora.targets: {t!r} matches no module of the model{example}")


def apply_lora(model: Any, train: Any, src: Path, precision: str) -> tuple[Any, list[str]]:
    """MODEL wrapped by peft with adapters on `train.lora.targets` (default: what the conversion
    of SRC changed) and those targets; only the adapters are trainable, and the frozen weights
    are cast to the compute dtype of PRECISION."""
    targets = resolve_targets(train.lora, src)
    return wrap(model, train.lora, targets, precision, checkpointing=train.gradient_checkpointing), targets


def resolve_targets(lora: Any, src: Path) -> list[str]:
    """`train.lora.targets`, or by default the projections the conversion of SRC changed."""
    return list(lora.targets or default_targets(src))


def wrap(model: Any, lora: Any, targets: list[str], precision: str, *, checkpointing: bool = False) -> Any:
    """MODEL wrapped by peft with LORA's adapters on TARGETS (checked first); the frozen weights
    cast to the compute dtype of PRECISION. The memory plan counts the model wrapped by this."""
    import torch

    check_targets(model, targets)
    frozen_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if checkpointing:
        model.enable_input_require_grads()  # the frozen embeddings would cut the checkpointed graph
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise GqakitError("train.lora needs the peft package: pip install 'peft>=0.21'") from None
    conv1d = any(type(m).__name__ == "Conv1D" for n, m in model.named_modules() if any(_matches(n, t) for t in targets))
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(targets),
                        bias="none", fan_in_fan_out=conv1d)
    try:
        wrapped = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    except (ValueError, TypeError) as e:
        raise GqakitError(f"train.lora.targets: peft cannot put adapters there: {first_line(e, 200)}") from None
    for p in wrapped.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != frozen_dtype:
            p.data = p.data.to(frozen_dtype)
    return wrapped


def merged_state_dict(state_dict: dict[str, Any], lora: Any, fan_in_fan_out: bool = False) -> dict[str, Any]:
    """The plain model's state dict from a peft one: W + (B @ A) * alpha / r for every adapted
    projection, in fp32, under the stock names; every other floating tensor in fp32 too."""
    scale = lora.alpha / lora.r
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(PEFT_PREFIX)
        if ".base_layer." in name:
            stem = key.rsplit(".base_layer.", 1)[0]
            name = name.replace(".base_layer.", ".")
            value = value.float() if value.is_floating_point() else value
            if key.endswith(".base_layer.weight") and f"{stem}.lora_A.{ADAPTER_NAME}.weight" in state_dict:
                a = state_dict[f"{stem}.lora_A.{ADAPTER_NAME}.weight"].float()
                b = state_dict[f"{stem}.lora_B.{ADAPTER_NAME}.weight"].float()
                delta = (b @ a) * scale
                value = value + (delta.T if fan_in_fan_out else delta)
        elif value.is_floating_point():
            value = value.float()
        out[name] = value
    return out


def merged_model(wrapped: Any, state_dict: dict[str, Any], lora: Any,
                 targets: list[str]) -> tuple[Any, dict[str, Any], dict[str, str]]:
    """For export: the plain model (adapter modules removed), its merged fp32 state dict, and
    the model card's line on the adapters."""
    import torch

    params = list(wrapped.parameters())
    n_params, n_train = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    card = {"LoRA": describe(lora, targets, n_train, n_params)}
    fan_in_fan_out = bool(getattr(wrapped.peft_config[ADAPTER_NAME], "fan_in_fan_out", False))
    merged = merged_state_dict(state_dict, lora, fan_in_fan_out)
    plain = wrapped.unload()
    # The folder records the dtype of its model's parameters: make them the fp32 of the merged
    # weights (on the host, where the model was loaded in fp32 before training).
    plain.to(device="cpu", dtype=torch.float32)
    return plain, merged, card


def describe(lora: Any, targets: list[str], n_train: int, n_params: int) -> str:
    """The model card's line: rank, scale and targets of the merged adapters."""
    return (f"rank {lora.r}, alpha {lora.alpha:g}, dropout {lora.dropout:g} on {short_targets(targets)} "
            f"({n_train:,} of {n_params:,} parameters trained, {n_train / n_params:.2%}); merged into the weights")
