"""Architecture knowledge as data.

Each model family is one JSON file in `convert/architectures/` (validated here with
`extra="forbid"`, so stale or misspelt keys fail loudly). A checkpoint's family is found
from `config.architectures[0]`, falling back to `config.model_type`. To support a new
family, add one JSON file there; nothing else needs to change unless its attention uses
a new fused layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from gqakit.core.errors import GqakitError

ARCH_DIR = "convert/architectures/"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigKeys(_Strict):
    """Names of the config.json keys that hold each quantity in this family."""

    num_layers: str
    num_heads: str
    num_kv_heads: str | None  # None: stock config has no such key (MHA only)
    hidden_size: str
    head_dim: str | None      # None: always hidden_size // num_heads


class Attention(_Strict):
    """Where one layer's attention projections live and how they are laid out.

    layouts:
      separate     q, k, v and o are separate Linear weights [out, in]
      fused_concat one qkv weight whose output axis is [q heads | k heads | v heads];
                   `transposed` for GPT-2's Conv1D, which stores [in, out]
      grouped_qkv  one qkv Linear whose output axis is (kv heads, H/kv + 2, head_dim):
                   each group's query heads, then its K head, then its V head (GPT-NeoX)
    """

    layout: Literal["separate", "fused_concat", "grouped_qkv"]
    prefix: str  # with "{layer}"
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    o: str
    transposed: bool = False

    @model_validator(mode="after")
    def _names_match_layout(self) -> "Attention":
        if "{layer}" not in self.prefix:
            raise ValueError("prefix must contain {layer}")
        if self.layout == "separate" and not (self.q and self.k and self.v) or self.layout != "separate" and not self.qkv:
            raise ValueError(f"layout {self.layout} needs " + ("q, k, v" if self.layout == "separate" else "qkv"))
        return self


class Rotary(_Strict):
    style: Literal["rotate_half", "interleaved", "none"]
    fraction_key: str | None = None  # config key of the rotary fraction (partial rotary)


class ArchSpec(_Strict):
    family: str
    model_types: list[str]
    architectures: list[str]
    native_gqa: bool  # stock transformers reads num_key_value_heads for this family
    config: ConfigKeys
    attention: Attention
    rotary: Rotary
    reject_if: dict[str, Any] = {}
    notes: str | None = None


@lru_cache(maxsize=1)
def registry() -> dict[str, ArchSpec]:
    specs: dict[str, ArchSpec] = {}
    for f in sorted(resources.files("gqakit.convert.architectures").iterdir(), key=lambda p: p.name):
        if not f.name.endswith(".json"):
            continue
        try:
            spec = ArchSpec.model_validate(json.loads(f.read_text()))
        except (ValidationError, json.JSONDecodeError) as e:
            raise RuntimeError(f"invalid architecture table {ARCH_DIR}{f.name}: {e}") from e
        specs[spec.family] = spec
    return specs


def supported() -> list[str]:
    return sorted(registry())


def lookup(config: dict[str, Any]) -> ArchSpec:
    """The family of a config.json dict, by `architectures[0]`, then `model_type`."""
    arch = (config.get("architectures") or [None])[0]
    mtype = config.get("model_type")
    for spec in registry().values():
        if arch in spec.architectures:
            return spec
    for spec in registry().values():
        if mtype in spec.model_types or mtype == f"gqakit_{spec.family}":
            return spec
    raise GqakitError(
        f"unsupported architecture {arch or mtype!r}; supported families: {', '.join(supported())}. "
        f"To add one, write a JSON entry in gqakit/{ARCH_DIR}"
    )


@dataclass(frozen=True)
class Shape:
    """The attention geometry of one checkpoint."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rotary_dim: int  # dims of each head that are rotated (0: no rotary)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def shape_of(spec: ArchSpec, config: dict[str, Any]) -> Shape:
    keys = spec.config

    def need(key: str) -> int:
        if key not in config or config[key] is None:
            raise GqakitError(f"config.json lacks {key!r}, which a {spec.family} config must have")
        return int(config[key])

    for key, bad in spec.reject_if.items():
        if config.get(key) == bad:
            raise GqakitError(f"{spec.family} with {key}={bad} is not supported ({spec.notes})")
    heads = need(keys.num_heads)
    hidden = need(keys.hidden_size)
    kv = config.get(keys.num_kv_heads or "num_key_value_heads") or heads
    head_dim = (config.get(keys.head_dim) if keys.head_dim else None) or hidden // heads
    rot = 0
    if spec.rotary.style != "none":
        # transformers 5 keeps the fraction in rope_parameters; older configs at top level
        rope = config.get("rope_parameters") or {}
        frac = config.get(spec.rotary.fraction_key) if spec.rotary.fraction_key else None
        frac = frac if frac is not None else rope.get("partial_rotary_factor", 1.0)
        rot = int(head_dim * float(frac))
    if heads % kv:
        raise GqakitError(f"config has {heads} query heads and {kv} KV heads, which do not divide")
    return Shape(need(keys.num_layers), heads, int(kv), int(head_dim), hidden, rot)
