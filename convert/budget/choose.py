"""The per-layer KV heads of a `--kv-budget` conversion (or `gqakit inspect --kv-budget`):
the budget in bytes, every check that needs no model, the damage of each layer's candidates
on the calibration text (`damage`), the exact allocation (`allocate`), and the record of it
all: the per-layer table with each candidate's damage and why the layer got its G.

The candidates are converted by a closed-form method: the conversion's own when it needs no
data; for align-refit, its closed-form fits (alignment, query refit, o_proj refit on the
calibration text: `refit_probe`), what its layers are before the reconstruction steps. Damages
add up across layers in the allocation's model (`allocate`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from gqakit.convert.budget import allocate as A
from gqakit.convert.budget.damage import candidate_heads, measure_damage
from gqakit.convert.budget.kvbudget import KvBudget
from gqakit.convert.refit_options import MAX_SEQ_LEN
from gqakit.convert.resolved import ResolvedSettings
from gqakit.convert.settings import ConvertSettings
from gqakit.convert.source import Opened, source_path
from gqakit.core import arch as archmod
from gqakit.core.device import available_memory
from gqakit.core.errors import GqakitError
from gqakit.core.units import DTYPE_BYTES, config_dtype, kv_bytes_text

REFIT_PROBE = "align-refit"  # the calibrated method whose closed-form fits `refit_probe` measures
# Damages are measured on at most this many calibration tokens: each candidate costs a pass of the
# whole model over them (the conversion itself streams one block at a time), so at the conversion's
# 65,536 tokens a 30-layer model would spend hours ranking layers.
DAMAGE_TOKENS = 16_384
PROBE_FOR_DATA_METHODS = "align"  # any other calibrated method: the closed-form start align-refit refines


def probe_method(settings: ConvertSettings) -> str:
    """What the candidates are measured with: the method itself when it needs no data, align-refit's
    closed-form fits for align-refit (`refit_probe`), else `align`."""
    if not settings.staged:
        return settings.method
    return REFIT_PROBE if settings.method == REFIT_PROBE else PROBE_FOR_DATA_METHODS


def probe_name(method: str) -> str:
    """The probe as the record and the card name it."""
    if method != REFIT_PROBE:
        return method
    from gqakit.convert.budget.refit_probe import PROBE  # it imports the calibration package: only with a budget

    return f"{method}'s {PROBE}"


@dataclass(frozen=True)
class KvChoice:
    """The allocation: each layer's G and the table that explains it."""

    kv_heads: tuple[int, ...]
    budget_bytes: int          # per token
    source_bytes: int          # per token, every head kept
    plan_bytes: int            # per token, the chosen plan
    dtype: str                 # the cache dtype the bytes are counted in
    table: list[dict[str, Any]]
    measured: dict[str, Any] | None  # how the damages were measured; None when nothing needed measuring

    @property
    def uniform(self) -> int | None:
        """The one G of every layer, or None for a per-layer plan."""
        return self.kv_heads[0] if len(set(self.kv_heads)) == 1 else None

    def record(self) -> dict[str, Any]:
        return {"budget_bytes_per_token": self.budget_bytes, "source_bytes_per_token": self.source_bytes,
                "plan_bytes_per_token": self.plan_bytes, "dtype": self.dtype, "kv_heads": list(self.kv_heads),
                "model": "additive: a plan's damage is the sum of each layer's damage measured alone",
                **({"measured": self.measured} if self.measured else {}), "layers": self.table}

    def lines(self) -> list[str]:
        """The plan as text: one line per layer, then the cache size."""
        out = [f"  {'layer':>5} {'G':>3} {'KV bytes/token':>15}  damage of each G (loss increase, nats/token); why"]
        for row in self.table:
            dm = ", ".join(f"G={g}: {d:+.4g}" for g, d in row["damage"].items())
            out.append(f"  {row['layer']:>5} {row['kv_heads']:>3} {row['bytes_per_token']:>15,}  {dm}; {row['why']}")
        pct = 100 * self.plan_bytes / self.source_bytes
        out.append(f"  KV cache {kv_bytes_text(self.plan_bytes, self.dtype)} ({pct:.1f}% of the source's "
                   f"{self.source_bytes:,}; budget {self.budget_bytes:,})")
        if self.measured:
            m = self.measured
            out.append(f"  damage measured with {m['probe']} on {m['calibration']} in {m['seconds']:.1f} s "
                       f"(source loss {m['base_loss']:.4f}; planned total damage {m['total_damage']:+.4g})")
        return out


def kv_elem_bytes(opened: Opened, spec: archmod.ArchSpec) -> tuple[int, str]:
    """Bytes per cached element and its dtype's name: the saved dtype, else the K weights'."""
    saved = config_dtype(opened.config)
    if saved:
        return DTYPE_BYTES[saved], saved
    from gqakit.convert.layout import layer_names

    names = layer_names(spec, 0)
    for role in ("k.weight", "qkv.weight"):
        if role in names and names[role] in opened.source.names():
            dt = opened.source.meta(names[role])[0]
            return dt.itemsize, str(dt).removeprefix("torch.")
    return 2, "float16"


@dataclass(frozen=True)
class Measured:
    """Each layer's candidates with their measured damage, and how they were measured."""

    layers: list[list[A.Candidate]]
    source_bytes: int
    dtype: str
    measured: dict[str, Any] | None


def _geometry(opened: Opened, settings: ConvertSettings) -> tuple[archmod.ArchSpec, archmod.Shape, int, list[int],
                                                                   int, str]:
    spec = archmod.lookup(opened.config)
    if spec.is_encoder_decoder:
        raise GqakitError(f"--kv-budget is for decoder-only models; give the {spec.family} encoder-decoder -g G")
    shape = archmod.shape_of(spec, opened.config)
    elem, dtype = kv_elem_bytes(opened, spec)
    return spec, shape, 2 * shape.head_dim * elem, candidate_heads(shape.num_heads, shape.num_kv_heads), \
        shape.kv_bytes_per_token(elem), dtype


def measure(opened: Opened, settings: ConvertSettings, *, device: str = "cpu", progress: bool = True) -> Measured:
    """The damage of every layer's candidates on the calibration text, at most its first
    `DAMAGE_TOKENS` tokens (loads the model in float32)."""
    spec, shape, per_head, cands, full, dtype = _geometry(opened, settings)
    t0 = time.perf_counter()
    source_params = sum(int(torch.Size(opened.source.meta(n)[1]).numel()) for n in opened.source.names())
    need, free = source_params * 4, available_memory(device)
    if need > free:
        raise GqakitError(f"measuring each layer's KV damage holds the whole model in float32 ({need / 1e9:.1f} GB, "
                          f"{free / 1e9:.1f} GB free on {device}); give -g G for a uniform conversion")
    seq_len = settings.refit.seq_len if isinstance(getattr(settings.refit, "seq_len", None), int) else MAX_SEQ_LEN
    from gqakit.convert.budget.refit_probe import FitOptions, measure_refit_damage  # the calibration package:
    from gqakit.convert.calibration.tokens import calibration_sequences  # only with a budget

    tokens = min(settings.calibration_tokens, DAMAGE_TOKENS)
    seqs, where = calibration_sequences(opened, settings.calibration_data, tokens, seq_len,
                                        settings.seed, device=device, progress=progress, source_params=source_params)
    from gqakit.core.loading import load_causal_lm

    model = load_causal_lm(source_path(opened), dtype=torch.float32, device=device, progress=progress)
    method = probe_method(settings)
    try:
        if method == REFIT_PROBE:
            dmg = measure_refit_damage(model, spec, shape, seqs, options=FitOptions.of(settings.refit),
                                       candidates=cands, device=device, progress=progress)
        else:
            dmg = measure_damage(model, spec, shape, seqs, method=method, candidates=cands, device=device,
                                 seed=settings.seed, progress=progress)
    finally:
        del model
    layers = [[A.Candidate(g, g * per_head, d[g]) for g in cands] for d in dmg.per_layer]
    return Measured(layers, full, dtype, {"method": method, "probe": probe_name(method), "grouping": "contiguous",
                                          "calibration": where, "tokens": dmg.tokens, "base_loss": dmg.base_loss,
                                          "seconds": round(time.perf_counter() - t0, 3), "device": str(device)})


def plan_for(m: Measured, budget: KvBudget) -> KvChoice:
    """The exact allocation of the measured candidates under `budget`."""
    limit = budget.bytes_of(m.source_bytes)
    picks = A.allocate(m.layers, limit)
    measured = {**(m.measured or {}), "total_damage": A.total_damage(m.layers, picks)}
    return _choice(m.layers, picks, A.reasons(m.layers, limit, picks),
                   [{c.heads: c.damage for c in cands} for cands in m.layers], limit, m.source_bytes, m.dtype,
                   measured)


def choose_kv_heads(opened: Opened, settings: ConvertSettings, *, device: str = "cpu",
                    progress: bool = True) -> KvChoice:
    """Each decoder layer's G under `settings.kv_budget`, measured on the calibration text. Every
    check that needs no model runs first: the budget against the smallest possible cache (one
    line naming it), the model kind, the memory the float32 model takes."""
    budget = settings.kv_budget
    assert budget is not None
    spec, shape, per_head, cands, full, dtype = _geometry(opened, settings)
    limit = budget.bytes_of(full)
    smallest = shape.num_layers * min(cands) * per_head
    if limit < smallest:
        raise A.BudgetTooSmall(f"--kv-budget {budget} is {limit:,} bytes per token ({dtype}), below the smallest "
                               f"possible KV cache of this model: {smallest:,} bytes per token ({min(cands)} KV head "
                               f"in each of {shape.num_layers} layers, {smallest / full:.4g} of the source's)")
    if limit >= full:  # the whole cache fits: every layer keeps its heads, nothing to measure
        damages = [{shape.num_kv_heads: 0.0}] * shape.num_layers
        layers = [[A.Candidate(shape.num_kv_heads, shape.num_kv_heads * per_head, 0.0)]] * shape.num_layers
        picks = A.allocate(layers, limit)
        why = ["kept every head: the budget holds the source's whole cache"] * shape.num_layers
        return _choice(layers, picks, why, damages, limit, full, dtype, None)
    fewest = sorted(cands)[:2]
    if len(fewest) == 1 or limit < smallest + (fewest[1] - fewest[0]) * per_head:
        # no layer can take more than the fewest heads: one plan fits, and nothing needs measuring
        g = fewest[0]
        layers = [[A.Candidate(g, g * per_head, 0.0)]] * shape.num_layers
        why = [f"G={g}: the only plan within the budget (no layer can take more heads; nothing measured)"] \
            * shape.num_layers
        return _choice(layers, A.allocate(layers, limit), why, [{}] * shape.num_layers, limit, full, dtype, None)
    return plan_for(measure(opened, settings, device=device, progress=progress), budget)


def _choice(layers: A.Layers, picks: tuple[int, ...], why: list[str], damages: list[dict[int, float]], limit: int,
            full: int, dtype: str, measured: dict[str, Any] | None) -> KvChoice:
    chosen = [layers[i][j] for i, j in enumerate(picks)]
    table = [{"layer": i, "kv_heads": c.heads, "bytes_per_token": c.cost,
              "damage": {str(g): d for g, d in damages[i].items()}, "why": why[i]}
             for i, c in enumerate(chosen)]
    return KvChoice(tuple(c.heads for c in chosen), limit, full, sum(c.cost for c in chosen), dtype, table, measured)


def budget_settings(settings: ConvertSettings, choice: KvChoice) -> ConvertSettings:
    """The settings a plan converts with: a uniform plan's `num_kv_heads` set to its one G (the
    -g conversion); a per-layer plan's heads go to `make_plan` (`choice.kv_heads`)."""
    g = choice.uniform
    if choice.plan_bytes == choice.source_bytes and not settings.force:
        raise GqakitError(f"--kv-budget {settings.kv_budget} keeps every KV head (the budget holds SRC's whole "
                          "cache): the conversion would write an unchanged copy; pass --force to write it anyway")
    if g is None:
        return settings
    return settings.model_copy(update={"num_kv_heads": g})


def choose_for(opened: Opened, settings: ConvertSettings, *, device: str = "cpu",
               progress: bool = True) -> tuple[ConvertSettings, KvChoice | None]:
    """A conversion's settings with `--kv-budget` decided (unchanged without one), and the choice."""
    if settings.kv_budget is None:
        return settings, None
    choice = choose_kv_heads(opened, settings, device=device, progress=progress)
    if progress:
        from tqdm import tqdm

        tqdm.write(f"--kv-budget {settings.kv_budget}: KV heads per layer {list(choice.kv_heads)}", file=sys.stderr)
    return budget_settings(settings, choice), choice


def with_choice(resolved: ResolvedSettings, choice: KvChoice | None) -> ResolvedSettings:
    """The resolved settings with the chosen per-layer KV heads and the allocation's record."""
    if choice is None:
        return resolved
    return dataclasses.replace(resolved, kv_choice=choice.record())
