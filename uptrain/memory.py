"""What one training micro-batch keeps in memory, counted without memory.

`count_model` builds the model from its config.json under torch's FakeTensorMode (every
tensor has a shape, a dtype and a storage size, and none has data), sets which weights
train exactly as the trainer does, and runs the trainer's own loss (`losses.token_losses`)
on a fake micro-batch. A saved-tensor hook records every tensor autograd keeps for the
backward pass, so the activation count is that of the real model code, attention kernel
and loss included, for any architecture transformers can build. Nothing is read but
config.json; a 70B shape is counted in seconds.

With `train.lora` the model is wrapped by the trainer's own peft call (`lora.wrap`), so the
adapters' parameters, their fp32 weights beside the frozen base in the compute dtype, and
what their forward keeps (their inputs, dropout masks) are counted as the run has them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from gqakit.core.loaded import decoder_blocks
from gqakit.core.errors import GqakitError
from gqakit.core.units import torch_dtype
from gqakit.uptrain.losses import token_losses

def set_trainable(model: Any, patterns: Sequence[str] | None, precision: str | None = None) -> None:
    """Train the parameters whose names match one of `patterns` (regexes; None = all). The
    frozen ones go to the compute dtype of `precision`: they need no fp32 master copy."""
    if not patterns:
        return
    for name, p in model.named_parameters():
        p.requires_grad_(any(re.search(pat, name) for pat in patterns))
    if not any(p.requires_grad for p in model.parameters()):
        raise GqakitError(f"train.trainable: no parameter name matches {list(patterns)}")
    if precision is not None:
        freeze_to(model, torch_dtype(precision))


def freeze_to(model: Any, dtype: torch.dtype) -> None:
    """Frozen weights in the compute dtype: only trained weights keep fp32 master copies."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


@dataclass
class Counts:
    """Bytes of one process's model state and of one micro-batch's saved activations."""

    params: int                      # parameters (tied ones once)
    trained: int                     # parameters that train
    weight_bytes: dict[str, int]     # by dtype name
    largest_block: int               # parameters of the largest decoder block
    outside_blocks: int              # parameters outside the decoder blocks (embeddings, head, final norm)
    saved: int                       # activations kept for the backward pass, whole micro-batch
    saved_blocks: list[int] = field(default_factory=list)  # of those, per decoder block
    block_inputs: int = 0            # bytes of the hidden states entering every block (kept under checkpointing)
    largest_saved: int = 0           # the largest single saved tensor (the logits, usually)
    teacher_bytes: int = 0           # the teacher's weights (fp32, as loaded)

    @property
    def checkpointed(self) -> int:
        """Saved activations with gradient checkpointing: every block keeps its input, and
        one block at a time is recomputed in full during the backward pass."""
        return self.saved - sum(self.saved_blocks) + self.block_inputs + max(self.saved_blocks, default=0)


@contextmanager
def _unpacked() -> Iterator[None]:
    """Training batches are whole blocks, never packed sequences with restarting positions.
    transformers can only see that from the data; with fake tensors it cannot look, and
    would build an explicit mask (and a costlier attention path) that the real run skips."""
    try:
        from transformers import masking_utils
    except ImportError:  # an older transformers without the check
        yield
        return
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        yield
        return
    old = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = old


@contextmanager
def _modules_stay_put() -> Iterator[None]:
    """peft moves each new adapter to its base layer's device and dtype with `Module.to`,
    which cannot swap fake parameters. Every fake tensor here is already on the one fake
    device, and the adapters are made in the base's dtype (fp32, as the trainer loads it):
    the move changes nothing, so it is skipped while the model is wrapped."""
    old = torch.nn.Module.to
    torch.nn.Module.to = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.to = old  # type: ignore[method-assign]


def _build(hf_config: Any, trust_remote_code: bool) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.config.use_cache = False
    return model


def count_model(hf_config: Any, *, trainable: Sequence[str] | None, seq_len: int, micro_batch: int, precision: str,
                teacher_config: Any | None = None, temperature: float = 1.0, hidden: bool = False,
                layer: bool = False, trust_remote_code: bool = False, lora: Any = None,
                lora_targets: Sequence[str] = ()) -> Counts:
    """Count parameters, weight bytes and saved activations of one training micro-batch.
    `lora` (r, alpha, dropout) with its resolved `lora_targets`: adapters, as the trainer adds them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if getattr(hf_config, "is_encoder_decoder", False):
        raise GqakitError(f"the memory plan covers decoder-only models; this is an encoder-decoder "
                          f"({getattr(hf_config, 'model_type', '?')})")
    compute = torch_dtype(precision)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _build(hf_config, trust_remote_code)
        model.train()
        set_trainable(model, trainable, precision)
        if lora is not None:
            from gqakit.uptrain.lora import wrap

            with _modules_stay_put():
                model = wrap(model, lora, list(lora_targets), precision)
        teacher = None
        if teacher_config is not None:
            teacher = _build(teacher_config, trust_remote_code).eval().requires_grad_(False)
        params = list(model.parameters())
        weight_bytes: dict[str, int] = {}
        for p in params:
            key = str(p.dtype).removeprefix("torch.")
            weight_bytes[key] = weight_bytes.get(key, 0) + p.numel() * p.element_size()
        blocks = decoder_blocks(model)
        in_blocks = {id(p) for p in blocks.parameters()}
        param_storages = {p.untyped_storage()._cdata for p in params}
        if teacher is not None:
            param_storages |= {p.untyped_storage()._cdata for p in teacher.parameters()}

        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s._cdata not in param_storages:
                seen[s._cdata] = s.nbytes()
            return t

        marks: list[int] = []
        inputs: list[int] = []

        def pre(mod: Any, args: tuple, kwargs: dict) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            inputs.append(h.numel() * h.element_size())
            marks.append(sum(seen.values()))

        def post(mod: Any, args: tuple, kwargs: dict, out: Any) -> None:
            marks.append(sum(seen.values()))

        handles = [h for b in blocks for h in (b.register_forward_pre_hook(pre, with_kwargs=True),
                                                b.register_forward_hook(post, with_kwargs=True))]
        x = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        autocast = torch.autocast("cpu", dtype=compute, enabled=compute != torch.float32)
        try:
            with autocast, _unpacked(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                token_losses(model, x, teacher, temperature, hidden=hidden, layer=layer)
        finally:
            for h in handles:
                h.remove()
        n_blocks = len(blocks)
        per_block = [marks[2 * i + 1] - marks[2 * i] for i in range(n_blocks)] if len(marks) >= 2 * n_blocks else []
        return Counts(
            params=sum(p.numel() for p in params),
            trained=sum(p.numel() for p in params if p.requires_grad),
            weight_bytes=weight_bytes,
            largest_block=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
            outside_blocks=sum(p.numel() for p in params if id(p) not in in_blocks),
            saved=sum(seen.values()),
            saved_blocks=per_block,
            block_inputs=sum(inputs[:n_blocks]),
            largest_saved=max(seen.values(), default=0),
            teacher_bytes=sum(p.numel() * p.element_size() for p in teacher.parameters()) if teacher is not None else 0,
        )
