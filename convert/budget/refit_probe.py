"""The damage of one layer as align-refit's closed-form fits leave it: the probe `--kv-budget`
measures a calibrated conversion's candidates with.

align-refit refits each layer after pooling, and the refit repairs much of the pooling's loss,
unevenly across layers; so the candidates are measured after the same closed-form fits (what
`calibration.refit.AlignRefit` does before its reconstruction steps). Only layer l is
converted, so the stream into it is the source's own: the "original" and "converted" inputs of
the fits are the same rows. For layer l and each candidate G, on the loaded source model:

  1. the float64 second moment of the layer's attention input (q_proj's input, the normed
     hidden state) with a constant 1 appended, over the calibration rows: its Cholesky factor
     is the metric of the alignment, and it is both moments of the query refit;
  2. contiguous groups, RoPE-aware alignment in that metric, mean pooling, the query refit
     (ridge `q_ridge`; skipped when it is < 0);
  3. the o_proj refit (ridge `o_ridge`; skipped when < 0): least squares of o_proj on the
     per-head attention outputs with the candidate's heads in the model (K/V repeated back),
     towards the source's attention output on the same rows (align-refit's "residual" and
     "local" targets are that same output here), rows weighted by 1/|x + attention output|
     with `row_weight` "relative" (x the layer's residual input);
  4. the damage: the calibration loss increase with the fitted layer in the model.

Forward hooks on the loaded model read the rows at the layer's roles (module names from the
family table, `layout.layer_names`), and stop the forward once they have them. Every pass starts
at the layer, on the source's hidden state kept there batch by batch (`stream.SourceStream`, moved
on one block per layer), so the layers before it are not run again. The normal equations are
accumulated batch by batch, so memory does not grow with the calibration text (the kept hidden
state is tokens x hidden in the model's dtype).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from gqakit.convert.align import add_moment, metric_factor, refit_o_proj_moments
from gqakit.convert.budget.damage import Damage, default_batch, layer_heads, repeated
from gqakit.convert.budget.stream import SourceStream
from gqakit.convert.calibration.tokens import span_rows
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.layout import AttnHeads, layer_names, write_heads
from gqakit.convert.methods import aligned_mean
from gqakit.convert.pooling import regroup
from gqakit.core import arch as archmod
from gqakit.core.errors import GqakitError

PROBE = "closed-form fits"  # the record's name for this probe (`choose.Measured`)


@dataclass(frozen=True)
class FitOptions:
    """The align-refit options the closed-form fits read (`of` a `RefitOptions`, which has them all)."""

    q_ridge: float
    o_ridge: float
    row_weight: str
    skip_first: int
    holdout: float

    @classmethod
    def of(cls, refit: Any) -> FitOptions:
        return cls(float(refit.q_ridge), float(refit.o_ridge), str(refit.row_weight), int(refit.skip_first),
                   float(refit.holdout))


class _Enough(Exception):
    """Raised by a hook once a forward has given what the probe needs of it."""


class _Sites:
    """The modules of layer `layer` whose inputs and outputs the fits read."""

    def __init__(self, model: torch.nn.Module, spec: archmod.ArchSpec, layer: int):
        names = layer_names(spec, layer)
        module = lambda n: model.get_submodule(n.rpartition(".")[0])  # noqa: E731
        self.block = model.get_submodule(spec.block_name(layer))
        self.q_in = module(names["q.weight"] if "q.weight" in names else names["qkv.weight"])
        self.o = module(names["o.weight"])
        bias = getattr(self.o, "bias", None)
        self.o_bias = None if bias is None else bias.detach().to(torch.float64)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _forward(model: torch.nn.Module, ids: Tensor, sites: _Sites, want: Sequence[str]) -> dict[str, Tensor]:
    """One forward on `ids` until it has given `want`, of: "x" (the layer's residual input),
    "h" (q_proj's input), "z" (o_proj's input), "out" (o_proj's output); rows, as computed."""
    got: dict[str, Tensor] = {}
    last = {"x": 0, "h": 1, "z": 2, "out": 3}
    stop = max(want, key=last.__getitem__)

    def keep(name: str, t: Tensor) -> None:
        if name in want:
            got[name] = _rows(t)
        if name == stop:
            raise _Enough

    handles = [sites.block.register_forward_pre_hook(
                   lambda m, a, k: keep("x", a[0] if a else k["hidden_states"]), with_kwargs=True),
               sites.q_in.register_forward_pre_hook(lambda m, a: keep("h", a[0])),
               sites.o.register_forward_pre_hook(lambda m, a: keep("z", a[0])),
               sites.o.register_forward_hook(lambda m, a, out: keep("out", out))]
    try:
        model(input_ids=ids)
    except _Enough:
        pass
    finally:
        for h in handles:
            h.remove()
    if set(got) != set(want):
        raise GqakitError(f"cannot measure the KV damage: the forward never reached {sorted(set(want) - set(got))}")
    return got


def closed_form_heads(heads: AttnHeads, g: int, moment: Tensor, whiten: Tensor, spec: archmod.ArchSpec,
                      shape: archmod.Shape, q_ridge: float) -> AttnHeads:
    """2. contiguous groups, alignment in the metric `whiten`, mean pooling, the query refit on
    `moment` (both of its moments: the streams are equal), float64 (`AlignRefit._fit_heads`)."""
    style, rdim = spec.rotary.style, shape.rotary_dim
    h = regroup(heads, GROUPINGS["contiguous"](heads, g, rotary_style=style, rotary_dim=rdim, whiten=whiten))
    return aligned_mean(h, g, rotary_style=style, rotary_dim=rdim, whiten=whiten, s_ab=moment, s_bb=moment,
                        q_ridge=q_ridge if q_ridge >= 0 else None)


class LayerProbe:
    """Layer `layer` of the loaded `model`: its input moments (on creation), the closed-form fit
    of any G, and the fitted heads written into (and the source's put back into) the model. Its
    forwards start at the layer, on `stream`'s kept inputs (`stream.SourceStream`, which must be
    at `layer`; without one, a stream is run up to the layer)."""

    def __init__(self, model: torch.nn.Module, spec: archmod.ArchSpec, shape: archmod.Shape, layer: int,
                 seqs: Tensor, opts: FitOptions, *, batch: int, device: torch.device | str = "cpu",
                 stream: SourceStream | None = None):
        self.model, self.spec, self.shape, self.layer, self.seqs = model, spec, shape, layer, seqs
        self.opts, self.device = opts, torch.device(device)
        if stream is None:
            stream = SourceStream(model, spec, shape.num_layers, seqs, batch, self.device).advanced_to(layer)
        if stream.layer != layer:
            raise ValueError(f"the stream is at layer {stream.layer}, the probe at {layer}")
        self.stream = stream
        self.params = dict(model.named_parameters())
        self.saved, self.heads = layer_heads(model, spec, shape, layer, self.params)
        self.sites = _Sites(model, spec, layer)
        self.moment, self.whiten = self._moments()

    def _keep(self, sl: slice) -> Tensor:
        n_seq, T = self.seqs.shape  # align-refit's rows (`skip_first` and `holdout` left out)
        return span_rows(n_seq, T, sl, holdout=self.opts.holdout, skip_first=self.opts.skip_first,
                         device=self.device)[0]

    def _forward(self, i: int, want: Sequence[str]) -> dict[str, Tensor]:
        with self.stream.at(i):
            return _forward(self.model, self.stream.ids(self.stream.spans[i]), self.sites, want)

    def _moments(self) -> tuple[Tensor, Tensor]:
        """1. E[h~ h~^T] of the layer's attention input h with 1 appended (float64, on the CPU), and
        the Cholesky factor of it with a 1e-8 relative jitter on the diagonal (as align-refit's)."""
        D = self.heads.q.shape[2]
        acc = torch.zeros(D + 1, D + 1, dtype=torch.float64, device=self.device)
        n = 0
        with torch.inference_mode():
            for i, sl in self.stream.batches():
                keep = self._keep(sl)
                h = self._forward(i, ["h"])["h"][keep].double()
                add_moment(acc, h, h)
                n += h.shape[0]
        if n == 0:
            raise GqakitError("no calibration rows left for the fits: lower skip_first or holdout, or pass "
                              "more --calibration-tokens")
        moment = (acc / n).cpu()
        return moment, metric_factor(moment)

    def fit(self, g: int) -> AttnHeads:
        """The layer's closed-form align-refit heads at G=`g` (G K/V heads, float64). Leaves the
        source's weights in the model."""
        pooled = closed_form_heads(self.heads, g, self.moment, self.whiten, self.spec, self.shape,
                                   self.opts.q_ridge)
        if self.opts.o_ridge >= 0:
            try:
                zz, zt = self._o_proj_equations(pooled)
            finally:
                self.restore()
            pooled = pooled.replace(o=refit_o_proj_moments(zz, zt, pooled.o, self.opts.o_ridge))
        return pooled

    def _o_proj_equations(self, pooled: AttnHeads) -> tuple[Tensor, Tensor]:
        """3. o_proj's normal equations Z^T Z, Z^T T (float64, on the CPU) with `pooled` in the
        model (`_weighted_rows`)."""
        HD = pooled.o.shape[1] * pooled.o.shape[2]
        zz = torch.zeros(HD, HD, dtype=torch.float64, device=self.device)
        zt = torch.zeros(HD, pooled.o.shape[0], dtype=torch.float64, device=self.device)
        for z, target in self._weighted_rows(pooled):
            zz.addmm_(z.T, z)
            zt.addmm_(z.T, target)
        return zz.cpu(), zt.cpu()

    def output_error(self, heads: AttnHeads) -> float:
        """What the o_proj refit minimises (less its ridge): the weighted squared error of the layer's
        attention output with `heads` in the model against the source's, summed over the fit rows.
        Leaves the source's weights in the model."""
        o = heads.o.reshape(heads.o.shape[0], -1).T.to(torch.float64).to(self.device)
        try:
            return float(sum(float((z @ o - target).pow(2).sum()) for z, target in self._weighted_rows(heads)))
        finally:
            self.restore()

    def _weighted_rows(self, heads: AttnHeads) -> Iterator[tuple[Tensor, Tensor]]:
        """Per batch, the fit rows of Z (o_proj's input with `heads` in the model) and of T (the
        source's attention output less o_proj's bias), float64, both times the row weights."""
        bias = None if self.sites.o_bias is None else self.sites.o_bias.to(self.device)
        with torch.inference_mode():
            for i, sl in self.stream.batches():
                keep = self._keep(sl)
                self.restore()
                src = self._forward(i, ["x", "out"])
                out, x = src["out"][keep].double(), src["x"][keep].double()
                if self.opts.row_weight == "relative":
                    w = (1.0 / (x + out).pow(2).mean(dim=1).clamp_min(1e-30)).sqrt().unsqueeze(1)
                else:
                    w = torch.ones(out.shape[0], 1, dtype=torch.float64, device=self.device)
                target = out if bias is None else out - bias
                self.put(heads)
                z = self._forward(i, ["z"])["z"][keep].double()
                yield z * w, target * w

    def put(self, heads: AttnHeads) -> None:
        """`heads` (G K/V heads) into the model's weights, K/V repeated back to the source's count."""
        full = repeated(heads, self.shape.num_kv_heads // heads.num_kv_heads)
        tensors = write_heads(self.spec, full, self.layer, {n: t.dtype for n, t in self.saved.items()})
        with torch.no_grad():
            for n, t in tensors.items():
                self.params[n].copy_(t.to(self.params[n].device))

    def restore(self) -> None:
        with torch.no_grad():
            for n, t in self.saved.items():
                self.params[n].copy_(t)


def measure_refit_damage(model: torch.nn.Module, spec: archmod.ArchSpec, shape: archmod.Shape, seqs: Tensor, *,
                         options: FitOptions, candidates: Sequence[int], device: torch.device | str = "cpu",
                         batch: int | None = None, progress: bool = True) -> Damage:
    """For each decoder layer and each G in `candidates` below the source's KV heads, the loss
    increase on `seqs` when only that layer is converted to G by align-refit's closed-form fits
    (the module docstring). The model's weights are restored after each measurement."""
    device = torch.device(device)
    KV = shape.num_kv_heads
    todo = [g for g in candidates if g != KV]
    if batch is None:
        batch = default_batch(seqs, int(model.get_output_embeddings().weight.shape[0]))
    per_g = 2 if options.o_ridge >= 0 else 1
    bar = tqdm(total=1 + shape.num_layers * (1 + per_g * len(todo)), desc="measuring each layer's damage",
               unit="pass", disable=not progress)
    stream = SourceStream(model, spec, shape.num_layers, seqs, batch, device)
    base = stream.base_loss
    bar.update(1)
    per_layer: list[dict[int, float]] = []
    for layer in range(shape.num_layers):
        if layer:
            stream.advance()  # the source's weights are in the model
        probe = LayerProbe(model, spec, shape, layer, seqs, options, batch=batch, device=device, stream=stream)
        bar.update(1)
        damage = {KV: 0.0}
        for g in todo:
            heads = probe.fit(g)
            bar.update(per_g - 1)
            try:
                probe.put(heads)
                loss = stream.loss()
            finally:
                probe.restore()
            if not math.isfinite(loss):
                raise GqakitError(f"the calibration loss is not finite with layer {layer} at G={g}")
            damage[g] = loss - base
            bar.update(1)
        per_layer.append(damage)
        del probe
    bar.close()
    return Damage(base, per_layer, int(seqs[:, 1:].numel()))
