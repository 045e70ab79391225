"""Sliding-window layers: which decoder layers attend over only the last `window` positions,
read off a config the way transformers decides it (and sizes its caches by).

transformers' rule, for every family: a config's `layer_types` list says each layer's kind
("sliding_attention" with the config's `sliding_window`, anything else full); a config without
one slides every layer when its `sliding_window` is set. Loaded configs have been through each
family's own config class, which fills `layer_types` where the family has a rule of its own; a
config.json dict has not, so a family's entry in the table (`sliding` in
`core/architectures/*.json`, the `SlidingWindow` model here) states that rule as data: which
layers slide when the dict has no `layer_types` (`all`; `periodic`: every `period`-th layer is
full, the others slide; `from`: the layers from index `from_key` on), the flag without which
none does (`enabled_key`), and transformers' defaults where config.json leaves a key out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from gqakit.core.errors import GqakitError

__all__ = ["SLIDING_TYPE", "SlidingWindow", "layer_windows_of"]

SLIDING_TYPE = "sliding_attention"  # transformers' name of a sliding layer in `layer_types`


class SlidingWindow(BaseModel):
    """How a family's config.json says which layers slide (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: Literal["all", "periodic", "from"]
    window_key: str = "sliding_window"      # the window, in positions (null: no layer slides)
    default_window: int | None = None       # transformers' window where config.json has no window_key
    layer_types_key: str = "layer_types"    # the per-layer list of kinds, which wins where present
    enabled_key: str | None = None          # a flag that must be true for any layer to slide
    period: int | None = None               # periodic: layer i is full when (i + 1) % period == 0
    period_key: str | None = None           # periodic: the config key of the period, read first
    from_key: str | None = None             # from: the key of the first sliding layer's index
    from_default: int | None = None         # from: transformers' index where config.json lacks from_key

    @model_validator(mode="after")
    def _pattern_keys(self) -> "SlidingWindow":
        if (self.layers == "periodic") != (self.period is not None or self.period_key is not None):
            raise ValueError("period or period_key go with layers periodic, and it needs one of them")
        if (self.layers == "from") != (self.from_key is not None):
            raise ValueError("from_key goes with layers from, and it needs it")
        return self


def _window(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise GqakitError(f"config.json's {key} = {value!r} must be a positive number of positions or null")
    return value


def layer_windows_of(rule: SlidingWindow | None, config: Mapping[str, Any],
                     num_layers: int) -> tuple[int | None, ...] | None:
    """Each layer's sliding window (None: full attention) of a config dict with `num_layers`
    decoder layers, by transformers' rule and the family's (`rule`, None for a family without
    one); None when no layer slides."""
    rule = rule or SlidingWindow(layers="all")
    window_key = rule.window_key
    enabled = rule.enabled_key is None or bool(config.get(rule.enabled_key))
    window = _window(config.get(window_key, rule.default_window), window_key) if enabled else None
    types = config.get(rule.layer_types_key)
    if types is not None:
        if not isinstance(types, (list, tuple)) or len(types) != num_layers:
            raise GqakitError(f"config.json's {rule.layer_types_key} must list the kind of each of its "
                              f"{num_layers} layers")
        slides = [t == SLIDING_TYPE for t in types]
    elif rule.layers == "periodic":
        period = config.get(rule.period_key) if rule.period_key else None
        period = int(period or rule.period or 0)
        if period < 1:
            raise GqakitError(f"config.json's {rule.period_key} = {period!r} must be at least 1")
        slides = [(i + 1) % period != 0 for i in range(num_layers)]
    elif rule.layers == "from":
        first = config.get(rule.from_key, rule.from_default)
        first = num_layers if first is None else int(first)
        slides = [i >= first for i in range(num_layers)]
    else:
        slides = [True] * num_layers
    windows = tuple(window if s else None for s in slides)
    return windows if any(w is not None for w in windows) else None
