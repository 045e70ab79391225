"""The source model on the meta device, one decoder block materialised at a time.

Built from its config under accelerate's `init_empty_weights`; outside the decoder blocks
everything but the LM head is loaded (the input embedding only for the rows of the
calibration tokens), and the model's own forward, with every block a pass-through,
computes block 0's input and records each block's extra arguments (rotary cos/sin, masks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gqakit.convert.source import Opened, source_path
from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError

BlockCall = tuple[tuple, dict, bool]  # a block's other positional and keyword inputs; hidden states positional?


class Stop(Exception):
    """Raised by a hook to end a forward pass early (the rest of it is not needed)."""


def split_hidden(args: tuple, kwargs: dict) -> tuple[Tensor, tuple, dict, bool]:
    """A block call's hidden states, its other inputs, and whether the hidden states came positionally."""
    if args:
        return args[0], args[1:], kwargs, True
    rest = dict(kwargs)
    return rest.pop("hidden_states"), (), rest, False


def call_block(block: Any, hidden: Tensor, call: BlockCall) -> Tensor:
    """The block on `hidden` with a recorded call's other inputs; its hidden-state output."""
    args, kwargs, positional = call
    out = block(hidden, *args, **kwargs) if positional else block(*args, hidden_states=hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _set_param(module: Any, name: str, value: Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    setattr(mod, attr, torch.nn.Parameter(value, requires_grad=False))


class Skeleton:
    """The source model on the meta device; materialises one decoder block at a time."""

    def __init__(self, opened: Opened, spec: archmod.ArchSpec, num_layers: int, device: str, dtype: torch.dtype):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        from gqakit.core.loading import load_config

        self.opened, self.source, self.device, self.dtype = opened, opened.source, device, dtype
        config = load_config(source_path(opened))
        with init_empty_weights(include_buffers=False):  # buffers (rotary inv_freq, masks) stay real
            self.model = AutoModelForCausalLM.from_config(config)
        self.model.eval()
        self.block_names = [spec.block_name(L) for L in range(num_layers)]
        self.blocks = [self.model.get_submodule(n) for n in self.block_names]
        self.body = getattr(self.model, "base_model", None) or self.model
        names = set(self.source.names())
        prefix = getattr(self.model, "base_model_prefix", "") + "."
        self._src_name = {}
        for name, _ in self.model.named_parameters():
            if name in names:
                self._src_name[name] = name
            elif name.startswith(prefix) and name[len(prefix):] in names:
                self._src_name[name] = name[len(prefix):]

    def src(self, name: str) -> str:
        if name not in self._src_name:
            raise GqakitError(f"tensor {name} of the {type(self.model).__name__} layout is not in the source model")
        return self._src_name[name]

    def load_outer(self, token_ids: Tensor) -> Tensor:
        """Materialise everything outside the blocks (not the LM head); the input embedding
        holds only the rows of `token_ids`. Returns the map from token id to its row."""
        emb = self.model.get_input_embeddings()
        out_emb = self.model.get_output_embeddings()
        in_blocks = tuple(n + "." for n in self.block_names)
        used = torch.unique(token_ids)
        for name, p in list(self.model.named_parameters()):
            if name.startswith(in_blocks):
                continue
            if p is emb.weight:
                rows = self.source.rows(self.src(name), used)
                _set_param(self.model, name, rows.to(device=self.device, dtype=self.dtype))
                emb.num_embeddings = rows.shape[0]
            elif out_emb is not None and p is out_emb.weight:
                continue  # logits are never computed
            else:
                _set_param(self.model, name, self.source.get(self.src(name)).to(device=self.device, dtype=self.dtype))
        for mod in self.model.modules():
            for bname, buf in list(mod.named_buffers(recurse=False)):
                if buf.device.type != "meta":
                    mod._buffers[bname] = buf.to(self.device, dtype=self.dtype if buf.is_floating_point() else None)
        remap = torch.full((int(token_ids.max()) + 1,), -1, dtype=torch.long)
        remap[used] = torch.arange(len(used))
        return remap

    def block_inputs(self, ids: Tensor, kwargs_out: dict[int, list]) -> Tensor:
        """Run the model up to the first block on `ids` [B, T]; returns block 0's input.

        The blocks are replaced by pass-throughs for this call, so the model's own code
        computes every block's extra inputs (rotary cos/sin, masks by layer type), which
        are recorded in `kwargs_out[B]` (once per batch size)."""
        B = ids.shape[0]
        record = B not in kwargs_out
        calls: list = []
        first: list[Tensor] = []
        hooks, saved_fwd = [], []

        def pre(mod, args, kwargs, L):
            hidden, rest, kw, positional = split_hidden(args, kwargs)
            if L == 0:
                first.append(hidden)
            if record:
                calls.append((rest, kw, positional))
            if L == len(self.blocks) - 1:
                raise Stop

        for L, blk in enumerate(self.blocks):
            hooks.append(blk.register_forward_pre_hook(lambda m, a, k, L=L: pre(m, a, k, L), with_kwargs=True))
            saved_fwd.append(blk.__dict__.get("forward"))
            blk.forward = lambda *a, **k: a[0] if a else k["hidden_states"]
        try:
            with torch.inference_mode():
                self.body(input_ids=ids.to(self.device), use_cache=False)
        except Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
            for blk, fwd in zip(self.blocks, saved_fwd):
                if fwd is None:
                    del blk.forward
                else:
                    blk.forward = fwd
        if record:
            if len(calls) != len(self.blocks):
                raise GqakitError(f"{type(self.model).__name__}: expected {len(self.blocks)} decoder blocks, "
                                  f"the forward pass called {len(calls)}")
            kwargs_out[B] = calls
        return first[0]

    def load_block(self, L: int) -> Any:
        block = self.blocks[L]
        for rel, _ in list(block.named_parameters()):
            t = self.source.get(self.src(f"{self.block_names[L]}.{rel}"))
            _set_param(block, rel, t.to(device=self.device, dtype=self.dtype))
        for mod in block.modules():
            for bname, buf in list(mod.named_buffers(recurse=False)):
                mod._buffers[bname] = buf.to(self.device, dtype=self.dtype if buf.is_floating_point() else None)
        return block

    def free_block(self, L: int) -> None:
        block = self.blocks[L]
        for rel, p in list(block.named_parameters()):
            _set_param(block, rel, torch.empty(p.shape, dtype=p.dtype, device="meta"))

    def materialised_blocks(self) -> list[int]:
        return [L for L, b in enumerate(self.blocks) if any(p.device.type != "meta" for p in b.parameters())]
