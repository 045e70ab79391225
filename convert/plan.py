"""The plan of a conversion: every output tensor's name, dtype and shape, in file order,
decided from the config and the tensor headers before anything is converted.

    source tensors (file order) --make_plan--> Plan.steps: PassThrough(name) for a tensor
    the method leaves as it is, AttentionLayer(layer, names) for the attention tensors of a
    layer the method rewrites (one step, where its first tensor is) --> Plan.tensors

An encoder-decoder's plan rewrites, per decoder layer, the self-attention and the
cross-attention, and, with `group_encoder`, each encoder layer's self-attention: each is
one step, with its site ("self", "cross", "encoder"; see `layout`). The methods that need
data (the calibration stage) and GGUF are refused for it (`settings.check_encoder_decoder`),
before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from gqakit.convert.io import Planned
from gqakit.convert.geometry_check import check_geometry
from gqakit.convert.layout import SITES, layer_names, output_shapes
from gqakit.convert.resolved import Output, ResolvedSettings, device_facts, resolve_settings
from gqakit.convert.settings import ConvertSettings
from gqakit.convert.source import Opened
from gqakit.core import arch as archmod
from gqakit.core.arch import SITE_NAMES
from gqakit.core.errors import GqakitError
from gqakit.core.units import torch_dtype

@dataclass(frozen=True)
class PassThrough:
    """A source tensor the method leaves as it is (cast to the output dtype, if any)."""

    name: str


@dataclass(frozen=True)
class AttentionLayer:
    """One layer's attention tensors, rewritten together by the method."""

    layer: int
    names: tuple[str, ...]  # in the table's role order; only those the method rewrites
    site: str = "self"      # which attention of the layer (`layout.SITES`)


Step = PassThrough | AttentionLayer


@dataclass
class Plan:
    family: str
    native_gqa: bool
    shape: archmod.Shape
    config: dict[str, Any]
    steps: list[Step]        # the source in file order; each layer's attention once, where it first appears
    tensors: list[Planned]   # the output tensors, step by step
    source_params: int
    output_params: int
    settings: ResolvedSettings  # every "auto" decided for this model (`resolved.resolve_settings`)
    encoder_shape: archmod.Shape | None = None  # an encoder-decoder's encoder (`shape` is its decoder)
    sites: tuple[str, ...] = ("self",)          # the attentions the conversion groups

    @cached_property
    def layer_of(self) -> dict[str, int]:
        """Attention tensor name -> layer, for the tensors the method rewrites."""
        return {n: s.layer for s in self.attention_layers() for n in s.names}

    def pass_through(self) -> list[PassThrough]:
        return [s for s in self.steps if isinstance(s, PassThrough)]

    def attention_layers(self) -> list[AttentionLayer]:
        """In layer order (the order methods and the calibration stage yield them); an
        encoder-decoder's sites in `layout.SITES` order within a layer."""
        return sorted((s for s in self.steps if isinstance(s, AttentionLayer)),
                      key=lambda s: (s.layer, SITES.index(s.site)))

    def shape_at(self, site: str) -> archmod.Shape:
        """The geometry of a site's attention: the encoder's for "encoder", else the decoder's."""
        if site == "encoder":
            assert self.encoder_shape is not None
            return self.encoder_shape
        return self.shape

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder_shape is not None

    @property
    def grouped(self) -> list[str]:
        """The attentions converted to the target KV heads, by name (e.g. "decoder.cross_attention")."""
        return [SITE_NAMES[site] for site in self.sites]


def make_plan(opened: Opened, settings: ConvertSettings, *, gguf_out: bool = False, device: str = "cpu",
              kv_heads: tuple[int, ...] | None = None) -> Plan:
    """The plan, with the settings resolved for this model (`Plan.settings`, built here once):
    what "auto" means depends on its parameters, context and width, on the output kind (a GGUF
    file with `gguf_out`, else a model folder) and on the device the conversion computes on
    (resolved, not "auto"; its free memory is measured here); `kv_heads`: each layer's KV heads
    as --kv-budget chose them."""
    output: Output = "gguf" if gguf_out else "folder"
    spec = archmod.lookup(opened.config)
    shape, encoder_shape, kv_heads = check_geometry(spec, opened.config, settings, gguf_out=gguf_out,
                                                    gguf_in=opened.gguf is not None, chosen=kv_heads)
    sites: tuple[str, ...] = ("self",)
    shape_at = {"self": shape, "cross": shape}
    if encoder_shape is not None:
        sites = ("self", "cross", "encoder") if settings.group_encoder else ("self", "cross")
        shape_at["encoder"] = encoder_shape
    src = opened.source
    names = src.names()
    metas = {n: src.meta(n) for n in names}
    numel = lambda s: int(torch.Size(s).numel())  # noqa: E731
    source_params = sum(numel(m[1]) for m in metas.values())
    resolved = resolve_settings(settings, source_params=source_params,
                                max_positions=archmod.max_positions(opened.config), output=output,
                                device=device_facts(device), hidden=shape.hidden_size, layers=shape.num_layers,
                                kv_heads=kv_heads)
    out_dtype = torch_dtype(resolved.dtype) if resolved.dtype is not None else None
    # methods that touch only K/V leave q and o to be copied through untouched
    kv_only = resolved.spec.kv_only and resolved.grouping == "contiguous" and spec.attention.layout == "separate"
    layer_of: dict[str, tuple[int, str]] = {}
    for site in sites:
        for layer in range(shape_at[site].num_layers):
            roles = layer_names(spec, layer, site)
            for role, name in roles.items():
                if name in metas and (not kv_only or role[0] in "kv"):
                    layer_of[name] = (layer, site)
                elif name not in metas and role.endswith("weight"):
                    where = ", ".join(p.name for p in src.files()) or "the source"
                    raise GqakitError(f"tensor {name} required by the {spec.family} layout but not present in {where}")
    steps = list(_walk(spec, names, layer_of))
    tensors: list[Planned] = []
    for step in steps:
        if isinstance(step, PassThrough):
            dt = metas[step.name][0]
            cast = out_dtype if (out_dtype is not None and dt.is_floating_point) else dt
            tensors.append(Planned(step.name, cast, metas[step.name][1]))
            continue
        shapes = output_shapes(spec, shape_at[step.site], resolved.kv_heads_at(step.layer), step.layer,
                               {n: metas[n][1] for n in step.names}, site=step.site)
        tensors += [Planned(n, out_dtype if out_dtype is not None else metas[n][0], shapes[n]) for n in step.names]
    return Plan(spec.family, spec.native_gqa, shape, opened.config, steps, tensors,
                source_params, sum(numel(p.shape) for p in tensors), resolved, encoder_shape, sites)


def _walk(spec: archmod.ArchSpec, names: list[str], layer_of: dict[str, tuple[int, str]]) -> Iterator[Step]:
    """The source tensors in file order, each layer's attention (of each site) as one step where
    its first tensor is."""
    seen: set[tuple[int, str]] = set()
    for name in names:
        if name not in layer_of:
            yield PassThrough(name)
        elif layer_of[name] not in seen:
            layer, site = layer_of[name]
            seen.add((layer, site))
            yield AttentionLayer(layer, tuple(n for n in layer_names(spec, layer, site).values() if n in layer_of),
                                 site)


def layer_kv_pairs(plan: Plan, settings: ResolvedSettings) -> list[tuple[int, int]]:
    """Each decoder layer's KV heads in the source and in the output (a layer whose two are equal
    keeps its heads: with align-refit it takes no reconstruction steps)."""
    return [(plan.shape.kv_heads_of(L), settings.kv_heads_at(L)) for L in range(plan.shape.num_layers)]


def trained_block_tensors(plan: Plan, settings: ResolvedSettings) -> set[str]:
    """The pass-through tensors the calibration stage rewrites (`--refit-option train=block`
    with reconstruction steps: the MLP and norms of each block whose KV heads are pooled), which the writer
    takes from the stage rather than from the source."""
    trains_block = getattr(settings.options, "trains_block", None)
    if not settings.staged or trains_block is None:
        return set()
    spec = archmod.registry()[plan.family]
    # the layers whose KV heads are pooled (a per-layer plan's others keep their heads and take no steps)
    prefixes = tuple(spec.block_name(L) + "." for L, (a, b) in enumerate(layer_kv_pairs(plan, settings))
                     if trains_block(a, b))
    return {s.name for s in plan.pass_through() if s.name.startswith(prefixes)} if prefixes else set()
