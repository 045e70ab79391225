"""Architecture knowledge as data: the one source of model geometry for every stage.

Each model family is one JSON file in `core/architectures/` (validated here with
`extra="forbid"`, so stale or misspelt keys fail loudly). A model's family is found
from `config.architectures[0]`, falling back to `config.model_type`. An entry says where
the decoder blocks are (`block`), where each block's attention tensors are and how they
are laid out (`attention`), which config.json keys hold the geometry (`config`, the
context length included), how rotary embeddings rotate (`rotary`), and, for families whose
stock transformers class has no GQA (or no per-layer KV heads: `remote.per_layer_only`), the
classes of gqakit's modeling file (`remote`).
It also holds what the other stages decide per family: the decoder-layer layout of the fast
CPU decode step (`decode`), and the GGUF architecture gqakit reads and writes with its own
tensor-name map (`gguf`). No code outside the table names a family or tells families apart
by their module names (`tests/test_family_seam.py`).
An encoder-decoder's entry also names its decoder's cross-attention (`cross_attention`) and
its encoder (`encoder`: blocks, layer and head keys, self-attention); `block`, `attention`
and `config` then describe the decoder.

To support a new family, add one JSON file there (and, only when transformers has no GQA
for it, `convert/remote/gqakit_modeling_<family>.py`); nothing else needs to change unless
its attention uses a new fused layout. `tests/test_architectures.py` checks every entry
against a tiny model built from it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from gqakit.core.errors import GqakitError
from gqakit.core.geometry import SITE_NAMES, Seq2SeqShape, Shape
from gqakit.core.windows import SlidingWindow, layer_windows_of

ARCH_DIR = "core/architectures/"
# context-length keys tried for a model whose family is not in the table (eval of any model)
FALLBACK_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigKeys(_Strict):
    """Names of the config.json keys that hold each quantity in this family."""

    num_layers: str
    num_heads: str
    num_kv_heads: str | None  # None: stock config has no such key (MHA only)
    num_layers_fallback: str | None = None  # read when num_layers is absent (T5: decoder depth = encoder's)
    hidden_size: str
    head_dim: str | None      # None: always hidden_size // num_heads
    max_positions: list[str]  # the context length: the first of these keys that is set
    # per-layer KV heads: "LIST[].PATH", a list of one entry per layer whose dotted PATH holds
    # the layer's query heads per KV head (nemotron-nas: block_configs[].attention.n_heads_in_group)
    heads_in_group: str | None = None
    # per-layer KV heads as a plain list of one count per layer (gqakit's own modeling files:
    # num_key_value_heads_per_layer); optional in a config: without it every layer has num_kv_heads
    kv_heads_list: str | None = None

    @model_validator(mode="after")
    def _one_per_layer_key(self) -> "ConfigKeys":
        if self.heads_in_group and self.kv_heads_list:
            raise ValueError("give heads_in_group or kv_heads_list, not both")
        return self


class QkNorm(_Strict):
    """RMSNorms on the q and k projections' outputs (module names inside the attention).

    scope "head": one norm per head, over head_dim, its weight shared by every head (Qwen3): it
    passes through a conversion unchanged. scope "projection": one norm over the whole
    projection, all heads jointly (OLMo-2): its weight has an entry per head and dim, so it is
    read as part of the heads, moves with them when they are regrouped and is pooled with K.
    """

    q: str | None = None
    k: str | None = None
    scope: Literal["head", "projection"]


class Attention(_Strict):
    """Where one layer's attention projections live and how they are laid out.

    layouts:
      separate     q, k, v and o are separate Linear weights [out, in]
      fused_concat one qkv weight whose output axis is [q heads | k heads | v heads];
                   `transposed` for GPT-2's Conv1D, which stores [in, out]
      grouped_qkv  one qkv Linear whose output axis is (kv heads, H/kv + 2, head_dim):
                   each group's query heads, then its K head, then its V head; with
                   kv = H that is the per-head interleaved (H, 3, head_dim) layout of
                   GPT-NeoX's and BLOOM's query_key_value, so a converted fused weight
                   keeps the layout its entry names
      fused_blocks one qkv Linear whose output axis is `blocks` equal blocks (the shards of
                   a model-parallel training run), each holding its share of the query heads,
                   K heads and V heads in `order` (CodeGen: 4 blocks of [q | v | k]). A
                   model with KV key/value heads uses gcd(blocks, KV) blocks, so a
                   grouped model with fewer KV heads than blocks stays expressible
                   (`block_count`); a source's heads must fill whole blocks

    `qk_norm`: norms of the q and k projections' outputs, applied before the rotary embedding.
    """

    layout: Literal["separate", "fused_concat", "grouped_qkv", "fused_blocks"]
    prefix: str  # with "{layer}"
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    o: str
    transposed: bool = False
    blocks: int | None = None                       # fused_blocks: the number of blocks
    order: list[Literal["q", "k", "v"]] | None = None  # fused_blocks: the parts within a block
    qk_norm: QkNorm | None = None

    @model_validator(mode="after")
    def _names_match_layout(self) -> "Attention":
        if "{layer}" not in self.prefix:
            raise ValueError("prefix must contain {layer}")
        blocked = self.layout == "fused_blocks"
        if blocked != (self.blocks is not None) or blocked != (self.order is not None):
            raise ValueError("blocks and order are given with layout fused_blocks, and only with it")
        if blocked and (self.blocks < 1 or sorted(self.order) != ["k", "q", "v"]):
            raise ValueError("fused_blocks needs blocks >= 1 and an order of q, k and v, each once")
        if self.layout == "separate" and not (self.q and self.k and self.v) or self.layout != "separate" and not self.qkv:
            raise ValueError(f"layout {self.layout} needs " + ("q, k, v" if self.layout == "separate" else "qkv"))
        return self

    def block_count(self, num_kv_heads: int) -> int:
        """fused_blocks: the blocks of a model with KV key/value heads, gcd(blocks, KV)
        (which divides the query heads too, since KV does)."""
        return math.gcd(self.blocks or 1, num_kv_heads)


class Rotary(_Strict):
    """How each head's leading dims are rotated: `rotate_half` pairs dim i with i + rotary_dim/2,
    `interleaved` (rotate-every-two) pairs 2i with 2i + 1. The rotated dims come first in each
    head; partial rotary names either the fraction of the head (`fraction_key`) or the number
    of rotated dims (`dim_key`, where a null value in config.json means the whole head)."""

    style: Literal["rotate_half", "interleaved", "none"]
    fraction_key: str | None = None  # config key of the rotary fraction (partial rotary)
    dim_key: str | None = None       # config key of the number of rotated dims (partial rotary)

    @model_validator(mode="after")
    def _one_key(self) -> "Rotary":
        if self.fraction_key and self.dim_key:
            raise ValueError("rotary names fraction_key or dim_key, not both")
        return self


QUERY_HEAD_ORDER = "gqakit_query_head_order"


class PositionBias(_Strict):
    """A position scheme bound to each query head's index: "alibi" adds a linear bias to the
    scores whose slope is a function of the head's index. A conversion that reorders query heads
    (a grouping that moves heads together) records, per layer, which source head each query head
    is (`QUERY_HEAD_ORDER` in config.json), and the family's modeling file gives each head the
    slope of that source head."""

    scheme: Literal["alibi"]
    config_key: str | None = None  # the config.json key that turns it on (dotted: nested); None: always on
    # whether transformers' class applies it over a preallocated (static) KV cache, whose mask
    # spans the whole cache; where not, generation takes a dynamic cache and eval --speed refuses
    static_cache: bool = True


class Remote(_Strict):
    """Classes of `convert/remote/gqakit_modeling_<family>.py` (or of `module`, when the family's
    classes live in another family's file), for families whose stock transformers class
    ignores num_key_value_heads, or (`per_layer_only`) reads one count for every layer."""

    config_class: str
    model_class: str
    module: str | None = None  # the modeling file's module name; None: gqakit_modeling_<family>
    # vLLM has its own class for the entry's `architectures` name, which reads the per-layer
    # heads: vLLM serves the folder with trust_remote_code (gqakit's file gives it the config
    # class), not through its Transformers backend
    vllm_class: bool = False
    # the stock class has GQA, so a uniform output is the stock folder (no modeling file); the file
    # is written only for an output whose layers have different KV heads (`config.kv_heads_list`)
    per_layer_only: bool = False


# The decoder-layer layouts the fast CPU decode step computes (`runtime/`): a layout's
# name is the family it was written for, but any family whose modules have that layout names
# it (Qwen2, Mistral, Gemma, Phi-3, ... use "llama"). "t5" is an encoder-decoder's decoder
# step (`runtime/t5_step.py`); the others are decoder-only models' layers.
DecodeLayout = Literal["llama", "gpt_neox", "gpt2", "opt", "phi", "t5"]


class Gguf(_Strict):
    """The GGUF architecture (`general.architecture`) of this family's GGUF files, for which
    gqakit maps tensor names with gguf-py's own table and can write GGUF output."""

    arch: str
    permute_qk: bool  # llama.cpp stores q/k rows permuted for its interleaved RoPE (undone on read)


class Features(_Strict):
    """An encoder that reads audio features (`input_features` [batch, bins, frames], e.g.
    log-mel spectrograms) instead of token ids: eval and uptrain then take paired feature/target
    files instead of text, and the speed grid's input lengths are frames."""

    bins: str                  # config key: feature bins per frame
    positions: str             # config key: the encoder's output positions for its longest input
    frames_per_position: int   # frames the encoder's front end folds into one output position


class Encoder(_Strict):
    """An encoder-decoder's encoder: where its blocks and their self-attention are, and the
    config.json keys of its layer and head counts (head_dim and hidden size are the decoder's)."""

    block: str                 # module path of encoder block {layer}, e.g. "encoder.block.{layer}"
    num_layers: str
    num_heads: str
    num_kv_heads: str          # written by a conversion that groups the encoder (absent: multi-head)
    attention: Attention
    features: Features | None = None  # None: the encoder reads token ids (`input_ids`)

    @model_validator(mode="after")
    def _attention_inside_block(self) -> "Encoder":
        _check_inside(self.block, self.attention, "encoder.attention")
        return self


def _check_inside(block: str, attention: Attention, what: str) -> None:
    if not block.endswith(".{layer}") or not attention.prefix.startswith(block + "."):
        raise ValueError(f"{what}.prefix {attention.prefix!r} must lie inside block {block!r}")


class ArchSpec(_Strict):
    family: str
    model_types: list[str]
    architectures: list[str]
    block: str                 # module path of decoder block {layer}, e.g. "model.layers.{layer}"
    remote: Remote | None      # None: stock transformers reads num_key_value_heads (native GQA)
    config: ConfigKeys
    attention: Attention       # the decoder's self-attention
    rotary: Rotary
    cross_attention: Attention | None = None  # an encoder-decoder's: inside each decoder block
    encoder: Encoder | None = None            # an encoder-decoder's encoder
    first_block_only: list[str] = []  # tensors (relative to a block) that only block 0 of a stack holds
    decode: DecodeLayout | None = None  # the fast CPU decode step's layout; None: the model's own step
    gguf: Gguf | None = None            # None: GGUF files are read through transformers' name map only
    position_bias: PositionBias | None = None  # per-query-head position bias (see PositionBias)
    reject_if: dict[str, Any] = {}  # config key (dotted: in a nested section) -> a value gqakit refuses
    # the family whose layout (and `remote` modeling file) writes this family's output when its
    # layers get different KV heads; None: a per-layer plan is refused for it
    per_layer_kv: str | None = None
    sliding: SlidingWindow | None = None  # which layers attend over a sliding window (core/windows.py)
    notes: str | None = None

    @model_validator(mode="after")
    def _attention_inside_block(self) -> "ArchSpec":
        _check_inside(self.block, self.attention, "attention")
        if self.cross_attention is not None:
            _check_inside(self.block, self.cross_attention, "cross_attention")
        if (self.cross_attention is None) != (self.encoder is None):
            raise ValueError("an encoder-decoder names both cross_attention and encoder")
        if self.decode is not None and (self.decode == "t5") != self.is_encoder_decoder:
            raise ValueError(f"decode {self.decode!r} is " + ("an encoder-decoder's decoder step"
                             if self.decode == "t5" else "a decoder-only model's layer layout"))
        if self.gguf is not None and self.is_encoder_decoder:
            raise ValueError("gguf: GGUF input and output are for decoder-only models")
        if self.remote is not None and self.remote.per_layer_only and (
                self.per_layer_kv != self.family or not self.config.kv_heads_list):
            raise ValueError("remote.per_layer_only: the modeling file is the family's own per-layer layout "
                             "(per_layer_kv names the family, config.kv_heads_list its list)")
        if self.position_bias is not None and (self.remote is None or self.is_encoder_decoder):
            raise ValueError("position_bias: the family's own decoder-only modeling file (remote) reads the "
                             "query head order")
        return self

    @property
    def native_gqa(self) -> bool:
        """Stock transformers reads num_key_value_heads for this family (a uniform output is the
        stock folder)."""
        return self.remote is None or self.remote.per_layer_only

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder is not None

    def position_bias_on(self, config: Mapping[str, Any]) -> bool:
        """Whether a config.json dict of this family has its per-query-head position bias on (then
        rotary is off, and a conversion that moves query heads records their order)."""
        bias = self.position_bias
        return bias is not None and (bias.config_key is None or bool(_config_value(config, bias.config_key)))

    def takes_static_cache(self, config: Mapping[str, Any]) -> bool:
        """Whether transformers' class for a config.json dict of this family computes over a
        preallocated (static) KV cache (see `PositionBias.static_cache`)."""
        bias = self.position_bias
        return bias is None or bias.static_cache or not self.position_bias_on(config)

    def attention_at(self, site: str) -> Attention:
        """The attention of a site: "self" (the decoder's self-attention), "cross" (the
        decoder's cross-attention) or "encoder" (the encoder's self-attention)."""
        at = {"self": self.attention, "cross": self.cross_attention,
              "encoder": self.encoder.attention if self.encoder else None}.get(site)
        if at is None:
            raise ValueError(f"{self.family} has no {site} attention")
        return at

    @property
    def blocks(self) -> str:
        """Module path of the ModuleList of decoder blocks, e.g. "model.layers"."""
        return self.block.removesuffix(".{layer}")

    def block_name(self, layer: int) -> str:
        return self.block.format(layer=layer)


@lru_cache(maxsize=1)
def registry() -> dict[str, ArchSpec]:
    specs: dict[str, ArchSpec] = {}
    for f in sorted(resources.files("gqakit.core.architectures").iterdir(), key=lambda p: p.name):
        if not f.name.endswith(".json"):
            continue
        try:
            spec = ArchSpec.model_validate(json.loads(f.read_text()))
        except (ValidationError, json.JSONDecodeError) as e:
            raise RuntimeError(f"invalid architecture table {ARCH_DIR}{f.name}: {e}") from e
        specs[spec.family] = spec
    archs = [s.gguf.arch for s in specs.values() if s.gguf]
    if len(archs) != len(set(archs)):
        raise RuntimeError(f"invalid architecture table {ARCH_DIR}: two entries name one gguf.arch ({archs})")
    return specs


def gguf_archs() -> dict[str, bool]:
    """GGUF architecture -> whether llama.cpp permutes its q/k rows, for the families whose
    entry names a `gguf` architecture (gqakit's own tensor-name map and GGUF output)."""
    return {s.gguf.arch: s.gguf.permute_qk for s in registry().values() if s.gguf}


def supported() -> list[str]:
    return sorted(registry())


def find(config: Mapping[str, Any]) -> ArchSpec | None:
    """The family of a config.json dict, by `architectures[0]`, then `model_type`; None if unknown."""
    arch = (config.get("architectures") or [None])[0]
    mtype = config.get("model_type")
    for spec in registry().values():
        if arch in spec.architectures or spec.remote and arch == spec.remote.model_class:
            return spec
    for spec in registry().values():
        if mtype in spec.model_types or mtype == f"gqakit_{spec.family}":
            return spec
    return None


def lookup(config: Mapping[str, Any]) -> ArchSpec:
    """`find`, or a one-line error that lists the supported families and the file to add."""
    spec = find(config)
    if spec is not None:
        return spec
    arch = (config.get("architectures") or [None])[0]
    mtype = config.get("model_type")
    raise GqakitError(
        f"unsupported architecture {arch or mtype!r}; supported families: {', '.join(supported())}. "
        f"To add one, write a JSON entry in gqakit/{ARCH_DIR}"
    )


def positions_of(config: Mapping[str, Any], keys: Sequence[str]) -> int | None:
    for key in keys:
        v = config.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def max_positions(config: Mapping[str, Any]) -> int | None:
    """The context length a config.json dict states (its family's keys; common keys for a
    family not in the table), or None."""
    spec = find(config)
    return positions_of(config, spec.config.max_positions if spec else FALLBACK_POSITION_KEYS)


def _config_value(config: Mapping[str, Any], key: str) -> Any:
    """config[key]; a dotted key reads a nested section ("attn_config.qk_ln"). None if absent."""
    if key in config:
        return config[key]
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def shape_of(spec: ArchSpec, config: Mapping[str, Any]) -> Shape:
    keys = spec.config

    def need(key: str) -> int:
        if key not in config or config[key] is None:
            raise GqakitError(f"config.json lacks {key!r}, which a {spec.family} config must have")
        return int(config[key])

    for key, bad in spec.reject_if.items():
        if _config_value(config, key) == bad:
            raise GqakitError(f"{spec.family} with {key}={bad} is not supported ({spec.notes})")
    heads = need(keys.num_heads)
    hidden = need(keys.hidden_size)
    if config.get(keys.num_layers) is None and keys.num_layers_fallback and config.get(keys.num_layers_fallback):
        config = {**config, keys.num_layers: config[keys.num_layers_fallback]}
    kv = config.get(keys.num_kv_heads or "num_key_value_heads") or heads
    head_dim = (config.get(keys.head_dim) if keys.head_dim else None) or hidden // heads
    rot = 0
    if spec.rotary.style != "none" and not spec.position_bias_on(config):
        # transformers 5 keeps the fraction in rope_parameters; older configs at top level
        rope = config.get("rope_parameters") or {}
        frac = config.get(spec.rotary.fraction_key) if spec.rotary.fraction_key else None
        frac = frac if frac is not None else rope.get("partial_rotary_factor", 1.0)
        rot = int(head_dim * float(frac))
        if spec.rotary.dim_key:
            rot = int(config.get(spec.rotary.dim_key) or head_dim)
            if rot > head_dim or rot % 2:
                raise GqakitError(f"config.json's {spec.rotary.dim_key}={rot} must be even and at most "
                                  f"the head size {head_dim}")
    per_layer = layer_kv_heads_of(keys, config, heads)
    if per_layer is not None:
        if len(per_layer) != need(keys.num_layers):
            raise GqakitError(f"config.json's {keys.heads_in_group or keys.kv_heads_list} has {len(per_layer)} "
                              f"entries for {need(keys.num_layers)} layers")
        kv = max(per_layer)
        per_layer = None if len(set(per_layer)) == 1 else per_layer
    if heads % kv:
        raise GqakitError(f"config has {heads} query heads and {kv} KV heads, which do not divide")
    if spec.attention.layout == "fused_blocks" and int(kv) == heads and heads % (spec.attention.blocks or 1):
        raise GqakitError(f"{spec.family} with {heads} heads is not supported: its fused "
                          f"{spec.attention.qkv} holds {spec.attention.blocks} blocks, which must each hold whole heads")
    return Shape(need(keys.num_layers), heads, int(kv), int(head_dim), hidden, rot,
                 positions_of(config, keys.max_positions), per_layer,
                 layer_windows_of(spec.sliding, config, need(keys.num_layers)))


def layer_kv_heads_of(keys: ConfigKeys, config: Mapping[str, Any], heads: int) -> tuple[int, ...] | None:
    """Each layer's KV heads where the family's config states them per layer (`heads_in_group`,
    or a `kv_heads_list` the config holds), checked to divide the query heads; None otherwise."""
    if keys.heads_in_group:
        return kv_heads_in_layers(keys.heads_in_group, config, heads)
    if not keys.kv_heads_list or config.get(keys.kv_heads_list) is None:
        return None
    entries = config[keys.kv_heads_list]
    if not isinstance(entries, (list, tuple)) or not entries:
        raise GqakitError(f"config.json's {keys.kv_heads_list} must be a list of each layer's KV heads")
    for i, g in enumerate(entries):
        if not isinstance(g, int) or isinstance(g, bool) or g < 1 or heads % g:
            raise GqakitError(f"config.json's {keys.kv_heads_list}[{i}] = {g!r} must divide the {heads} query heads")
    return tuple(entries)


def kv_heads_in_layers(key: str, config: Mapping[str, Any], heads: int) -> tuple[int, ...]:
    """Each layer's KV heads from a per-layer list ("LIST[].PATH": PATH holds the layer's query
    heads per KV head), checked to divide the query heads."""
    name, _, path = key.partition("[].")
    entries = config.get(name)
    if not isinstance(entries, list) or not entries:
        raise GqakitError(f"config.json lacks the per-layer list {name!r}")
    out = []
    for i, entry in enumerate(entries):
        group = entry
        for part in path.split("."):
            group = group.get(part) if isinstance(group, Mapping) else getattr(group, part, None)
        if not isinstance(group, int) or isinstance(group, bool) or group < 1 or heads % group:
            raise GqakitError(f"config.json's {name}[{i}].{path} = {group!r} must divide the {heads} query heads")
        out.append(heads // group)
    return tuple(out)


def encoder_shape_of(spec: ArchSpec, config: Mapping[str, Any]) -> Shape:
    """The encoder's geometry of an encoder-decoder's config.json dict (its own layer, head and
    KV-head keys; head_dim and hidden size are the decoder's)."""
    if spec.encoder is None:
        raise GqakitError(f"{spec.family} has no encoder")
    enc = spec.encoder
    overrides = {spec.config.num_layers: config.get(enc.num_layers), spec.config.num_heads: config.get(enc.num_heads),
                 spec.config.num_kv_heads or "num_key_value_heads": config.get(enc.num_kv_heads)}
    missing = [k for k in (enc.num_layers, enc.num_heads) if config.get(k) is None]
    if missing:
        raise GqakitError(f"config.json lacks {missing[0]!r}, which a {spec.family} config must have")
    return shape_of(spec, {**config, **overrides})
