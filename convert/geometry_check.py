"""The checks of a conversion's geometry that need only config.json and the settings (no torch,
no tensor): -g G or a per-layer KV plan against each attention's KV heads, the encoder-decoder
refusals, and a conversion that would change nothing. `make_plan` runs them for every caller;
the CLI runs them first, so that a wrong -g is answered before the heavy imports.
"""

from __future__ import annotations

from typing import Any

from gqakit.convert.settings import ConvertSettings, check_encoder_decoder
from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError
from gqakit.core.units import DTYPE_BYTES, config_dtype, kv_bytes_text


def check_geometry(spec: archmod.ArchSpec, config: dict[str, Any], settings: ConvertSettings, *, gguf_out: bool,
                   gguf_in: bool, chosen: tuple[int, ...] | None = None
                   ) -> tuple[archmod.Shape, archmod.Shape | None, tuple[int, ...] | None]:
    """(the decoder's shape, the encoder's or None, each layer's KV heads or None for a uniform
    -g) of a model of family SPEC and CONFIG converted with SETTINGS (to a GGUF file with
    GGUF_OUT, from one with GGUF_IN; CHOSEN: the KV heads --kv-budget chose), after every check."""
    check_encoder_decoder(spec, settings, gguf=gguf_out or gguf_in)
    shape = archmod.shape_of(spec, config)
    encoder_shape = archmod.encoder_shape_of(spec, config) if spec.is_encoder_decoder else None
    kv_heads = layer_kv_heads(spec, shape, settings, config, gguf_out=gguf_out, chosen=chosen)
    if kv_heads is None:
        validate_g(shape, settings.num_kv_heads or 0, "the decoder's" if encoder_shape else "the model's")
    if encoder_shape is not None and settings.group_encoder:
        validate_g(encoder_shape, settings.num_kv_heads, "the encoder's")
    check_changes(shape, encoder_shape if settings.group_encoder else None, settings, kv_heads)
    return shape, encoder_shape, kv_heads


def validate_g(shape: archmod.Shape, g: int, whose: str = "the model's") -> None:
    kv = shape.num_kv_heads
    if g <= 0:
        raise GqakitError(f"--num-kv-heads must be at least 1, got {g}")
    if g > kv:
        raise GqakitError(f"--num-kv-heads {g} is larger than {whose} {kv} KV heads")
    if kv % g:
        valid = [d for d in range(1, kv + 1) if kv % d == 0]
        raise GqakitError(f"--num-kv-heads {g} does not divide {whose} {kv} KV heads; valid: {valid}")


def check_changes(shape: archmod.Shape, encoder_shape: archmod.Shape | None, settings: ConvertSettings,
                  kv_heads: tuple[int, ...] | None = None) -> None:
    """Refuse a conversion that groups nothing (G equal to the KV heads of every attention it
    converts: the output would be a copy) unless `settings.force`."""
    if kv_heads is not None:
        if settings.force or any(g != shape.kv_heads_of(L) for L, g in enumerate(kv_heads)):
            return
        raise GqakitError("the KV plan keeps SRC's KV heads in every layer: the conversion would write an "
                          "unchanged copy; pass --force to write it anyway")
    g = settings.num_kv_heads
    if settings.force or g != shape.num_kv_heads or (encoder_shape is not None and g != encoder_shape.num_kv_heads):
        return
    raise GqakitError(f"--num-kv-heads {g} is already SRC's KV head count: the conversion would write an "
                      "unchanged copy; pass --force to write it anyway")


def sliding_windows(shape: archmod.Shape) -> list[int]:
    """The windows of the layers that attend to fewer positions than the model's context (the
    table's rule for the family, or the config's `layer_types`: `core.windows`)."""
    limit = shape.max_positions or 0
    return [w for w in (shape.layer_windows or ()) if w is not None and w < limit]


def layer_kv_heads(spec: archmod.ArchSpec, shape: archmod.Shape, settings: ConvertSettings,
                   config: dict[str, Any], *, gguf_out: bool,
                   chosen: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """The KV heads of each decoder layer (`chosen` by --kv-budget, `--kv-plan`, or -g on a source
    whose layers differ), each checked against its layer; None for -g on a uniform source. A
    non-uniform plan for a family (or output) that cannot express it is refused, naming the
    nearest uniform G."""
    heads = chosen if chosen is not None else settings.plan_heads
    if heads is None:
        if shape.kv_heads_per_layer is None:
            return None
        heads = (settings.num_kv_heads or 0,) * shape.num_layers
    if spec.is_encoder_decoder:
        raise GqakitError(f"--kv-plan is for decoder-only models; use -g for the {spec.family} encoder-decoder")
    if len(heads) != shape.num_layers:
        raise GqakitError(f"--kv-plan gives {len(heads)} layers' KV heads, but SRC has {shape.num_layers} "
                          "decoder layers")
    for L, g in enumerate(heads):
        kv = shape.kv_heads_of(L)
        if g < 1 or g > kv or kv % g:
            valid = [d for d in range(1, kv + 1) if kv % d == 0]
            raise GqakitError(f"layer {L + 1}: {g} KV heads do not divide its {kv} KV heads "
                              f"({shape.num_heads} query heads); valid: {valid}")
    if len(set(heads)) == 1 and shape.kv_heads_per_layer is None:
        return heads
    why = None
    if spec.per_layer_kv is None:
        why = f"a {spec.family} model folder has one KV head count for every layer"
    elif gguf_out and (spec.gguf is None or not spec.gguf.permute_qk):
        why = ("a per-layer GGUF is llama.cpp's deci architecture, which takes the Llama GGUF layout; "
               f"convert this {spec.family} GGUF to a model folder")
    elif spec.per_layer_kv != spec.family and (windows := sliding_windows(shape)):
        # the family's own layout keeps its attention, window included; another family's may not
        why = f"SRC's attention has a sliding window ({min(windows)}), which the per-layer layout lacks"
    if why is not None:
        raise GqakitError(f"the per-layer KV plan cannot be written: {why}; the nearest uniform plan is "
                          f"{nearest_uniform(shape, heads, config)}")
    return heads


def nearest_uniform(shape: archmod.Shape, heads: tuple[int, ...], config: dict[str, Any]) -> str:
    """'-g G (N B/token (dtype))': the uniform G whose cache is closest to the plan's."""
    kv = min(shape.kv_heads_of(L) for L in range(shape.num_layers))
    dtype = config_dtype(config) or "float32"
    goal = sum(heads)
    g = min((d for d in range(1, kv + 1) if all(shape.kv_heads_of(L) % d == 0 for L in range(shape.num_layers))),
            key=lambda d: (abs(d * shape.num_layers - goal), d))
    size = shape.kv_bytes_per_token(DTYPE_BYTES[dtype], g)
    return (f"-g {g} ({kv_bytes_text(size, dtype)}; the plan: "
            f"{kv_bytes_text(shape.kv_bytes_per_token(DTYPE_BYTES[dtype], heads), dtype)})")
