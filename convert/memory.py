"""A conversion of a transformers model in memory (`gqakit.convert_model`): nothing is written.

The model's state dict is the source (`io.DictSource`), so the plan (`plan.make_plan`), the
heads of each layer (`pipeline.per_step_heads`: read, group, pool) and their tensors
(`layout.write_heads`) are the folder conversion's; the converted config is the one the
folder conversion writes (`record.output_config`). A new model of the same class is built from
it and given the converted state dict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gqakit.convert.io import DictSource, Opened
from gqakit.convert.layout import write_heads
from gqakit.convert.pipeline import per_step_heads
from gqakit.convert.plan import make_plan
from gqakit.convert.record import output_config
from gqakit.convert.settings import ConvertSettings
from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError


def convert_in_memory(model: Any, num_kv_heads: int, method: str = "mean", *, grouping: str = "auto",
                      seed: int = 0, force: bool = False) -> Any:
    """`model` (a transformers model) with `num_kv_heads` K/V heads per layer, as a new model of
    its class, dtype and device; `model` is not changed."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(model, "state_dict"):
        raise GqakitError(f"convert_model takes a transformers model (got {type(model).__name__})")
    cfg = config.to_dict()
    spec = archmod.lookup(cfg)  # an unsupported family: one line naming the supported ones
    if spec.is_encoder_decoder or not spec.native_gqa:
        raise GqakitError(f"convert_model: transformers' {spec.family} class has no grouped-query attention; save the "
                          "model (save_pretrained) and convert the folder with gqakit.convert, which writes gqakit's "
                          "modeling file beside the weights")
    name = getattr(config, "name_or_path", "") or "model"
    settings = ConvertSettings(source=name, num_kv_heads=num_kv_heads, method=method, grouping=grouping, seed=seed,
                               force=force)
    if settings.staged:
        raise GqakitError(f"convert_model: method {method} calibrates on text through the model; save the model "
                          "(save_pretrained) and convert the folder with gqakit.convert")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    opened = Opened(Path(name), None, cfg, DictSource(state))
    plan = make_plan(opened, settings)
    dtypes = {p.name: p.dtype for p in plan.tensors}
    with torch.no_grad():
        for step, heads in per_step_heads(opened, plan, plan.settings):
            state.update(write_heads(spec, heads, step.layer, {n: dtypes[n] for n in step.names}, site=step.site))
    new_config = type(config).from_dict(output_config(plan, plan.settings))
    attn = getattr(config, "_attn_implementation", None)
    if attn is not None:
        new_config._attn_implementation = attn
    param = next(model.parameters())
    new = type(model)._from_config(new_config, dtype=param.dtype)
    new.load_state_dict(state, strict=True)
    new.to(param.device)
    new.train(model.training)
    if getattr(model, "generation_config", None) is not None:
        new.generation_config = model.generation_config
    return new
