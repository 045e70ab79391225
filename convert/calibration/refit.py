"""`align-refit`'s fit of one block, from the original stream x and the converted stream x':

  1. moments E[x~ x~^T], E[x~ x~'^T], E[x~' x~'^T] of the attention inputs (normed, with
     a constant 1 appended), accumulated in float64 batch by batch (each batch's product
     in float64 for the metric E[x~ x~^T], in float32 for the others unless the block computes
     in float64);
  2. grouping (optional, by aligned-weight similarity in the input metric), then
     RoPE-aware alignment in the metric of E[x x^T], then mean pooling;
  3. query refit: per query head, the RoPE-commuting map (scaled 2x2 rotation per
     frequency pair, full matrix on unrotated dims) that best reproduces its original
     keys k_j(x) from the pooled keys k'(x'), by ridge least squares on those moments;
  4. o_proj refit: ridge least squares of o_proj on the converted block's per-head
     attention outputs, towards the original model's residual stream after this
     attention (original attention output + original residual - converted residual), so
     each layer also corrects the drift of the layers before it. Its normal equations
     are accumulated batch by batch in float64 (as the moments), rows weighted by 1/|original residual|^2
     (`row_weight`), so outsized "attention sink" rows do not dominate. The same pass
     advances the original stream;
  5. block-wise reconstruction (optional, `steps` > 0; BRECQ / AutoRound style): Adam
     steps on the block's converted q, k, v, o (K/V shared per group, the rest of the
     block frozen) minimising the relative squared error between the block's output on
     the converted stream and the original block's output on the original stream
     (`loss` = "block"), or the o_proj refit's own objective, step 4's weighted error of
     the residual stream after attention (`loss` = "attention": a step then stops at
     o_proj and never runs the rest of the block), seeded per layer, with a held-out
     guard that keeps the closed-form fit when the steps do not help. With `train` =
     "block" the steps also train the rest of the block (MLP and norms), which the
     writer then takes from the stage.

The math itself is in `convert.align` and `convert.grouping`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gqakit.convert.align import add_moment, add_product, metric_factor, refit_o_proj_moments
from gqakit.convert.calibration.block import BlockContext, Fitted, Grab
from gqakit.convert.calibration.memory import trim
from gqakit.convert.calibration.steploss import SpanLoss
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.layout import AttnHeads, read_heads
from gqakit.convert.methods import aligned_mean
from gqakit.convert.pooling import regroup
from gqakit.convert.refit_options import ResolvedRefitOptions
from gqakit.core.errors import GqakitError


def span_order(n: int, steps: int, gen: torch.Generator) -> list[int]:
    """Which of `n` spans each of `steps` reconstruction steps trains on: every span once per
    epoch, in a fresh random order each epoch (drawn from `gen`, so a seed fixes the order)."""
    order: list[int] = []
    while len(order) < steps:
        order += torch.randperm(n, generator=gen).tolist()
    return order[:steps]


def check_steps(steps: int, checks: int) -> set[int]:
    """The steps after which the guard is evaluated: `checks` of them, evenly spaced, the last one
    included (at most one per step)."""
    n = min(checks, steps)
    return {round(steps * i / n) for i in range(1, n + 1)} if steps else set()


class EarlyStop:
    """The guard's bookkeeping over a layer's steps: the best loss so far (the closed-form fit's
    to begin with, at step 0) and when it was reached; `stop` once `patience` evaluations in a row
    have not improved on it (never with `patience` 0)."""

    def __init__(self, start: float, patience: int):
        self.best, self.best_at, self.patience, self.since = start, 0, patience, 0

    def update(self, loss: float, step: int) -> bool:
        """Record the guard loss after `step`; whether it is the best so far."""
        if loss < self.best:
            self.best, self.best_at, self.since = loss, step, 0
            return True
        self.since += 1
        return False

    @property
    def stop(self) -> bool:
        return self.patience > 0 and self.since >= self.patience


class AlignRefit:
    """The `align-refit` fit (see the module docstring); one instance per conversion."""

    def __init__(self, opts: ResolvedRefitOptions, *, grouping: str, seed: int, kv: Sequence[tuple[int, int]],
                 dtype: torch.dtype, device: str):
        """`kv`: each layer's KV heads in the source and in the output."""
        self.opts, self.grouping, self.seed, self.dtype, self.device = opts, grouping, seed, dtype, device
        # block-wise reconstruction steps, in the layers whose KV heads are pooled: none in a layer
        # that keeps them (with -g, none at all: the conversion is exact)
        self.steps_at = [opts.train_steps(a, b) for a, b in kv]
        self.block_at = [opts.trains_block(a, b) for a, b in kv]
        self.final_at = [bool(s) and opts.refits_o_after_steps for s in self.steps_at]  # o_proj again after them
        self.recon: list[dict[str, Any]] = []
        self.targets: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def rows_dtype(self) -> torch.dtype:
        """The dtype the normal equations' rows are multiplied in: float64 where the block computes
        in it, else float32 (the products summed over a span in float32, over the spans in float64)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def units(self, n_spans: int, layer: int) -> int:
        return 2 * n_spans + self.steps_at[layer] + (n_spans if self.final_at[layer] else 0)

    def steps(self, layer: int) -> int:
        return self.steps_at[layer]

    def fit(self, ctx: BlockContext) -> Fitted:
        blk = ctx.block
        whiten, s_on, s_nn = self._input_moments(ctx)
        blk.free()  # the CPU fits do not need it: back to meta, read again after
        pooled = self._fit_heads(ctx, whiten, s_on, s_nn)
        del whiten, s_on, s_nn
        trim()
        blk.load()
        pooled, converted = self._fit_o_proj(ctx, pooled)
        rest: dict[str, Tensor] = {}
        if self.steps_at[ctx.layer]:
            pooled, converted = self._reconstruct(ctx, pooled)
            if self.block_at[ctx.layer]:
                rest = blk.trained_rest()
        return Fitted(pooled, converted, rest)

    def record(self) -> dict[str, Any]:
        return {"reconstruction": self.recon} if any(self.steps_at) else {}

    @staticmethod
    def describe(calibration: dict[str, Any]) -> str:
        """What `align-refit` did, in one line for the model card (from its calibration record)."""
        opts = calibration.get("options", {})
        parts = ["RoPE-aware alignment of each group's heads in the metric of the layer's input activations, "
                 "mean pooling"]
        if float(opts.get("q_ridge", 0)) >= 0:
            parts.append("query refit (per-frequency scaled rotations) by ridge least squares")
        if float(opts.get("o_ridge", 0)) >= 0:
            parts.append(f"o_proj ridge refit towards the original model's {opts.get('target', 'residual')} stream")
        if calibration.get("reconstruction"):
            what = "every weight of the block" if opts.get("train") == "block" else "q, k, v and o"
            towards = ("the o_proj refit's target (the original residual stream after attention)"
                       if opts.get("loss") == "attention" else "the original block's output")
            parts.append(f"block-wise reconstruction: {int(opts['steps'])} Adam steps per layer whose KV heads were "
                         f"pooled, on {what} "
                         f"(lr {opts['lr']} x each tensor's RMS, decaying linearly) towards {towards}; each layer "
                         f"keeps whichever of the closed-form fit and the trained weights"
                         + (", and the trained q, k, v with o_proj refitted in closed form after the steps,"
                            if any("final_o" in r for r in calibration["reconstruction"]) else "")
                         + " had the lower guard loss"
                         + (f", and stops after {int(opts['patience'])} guard evaluations without improvement"
                            if int(opts.get("patience", 0)) else ""))
        return "; ".join(parts)

    def _input_moments(self, ctx: BlockContext) -> tuple[Tensor, Tensor, Tensor]:
        """1. moments of the attention inputs [x 1] of both streams, batch by batch (`rows_dtype`):
        (Cholesky factor of E[x~ x~^T], E[x~ x~'^T], E[x~' x~'^T]), on the CPU."""
        blk = ctx.block
        D, f64 = ctx.hidden, torch.float64
        s_oo = torch.zeros(D + 1, D + 1, dtype=f64, device=self.device)
        s_on, s_nn = torch.zeros_like(s_oo), torch.zeros_like(s_oo)
        n_rows = 0
        g = Grab(blk.q_in, stop=True)
        rows = self.rows_dtype
        with torch.inference_mode():
            try:
                for sl in ctx.passes:
                    keep = ctx.masks(sl)[0]
                    blk.run(sl, "orig")
                    xo = g.rows[keep]
                    blk.run(sl, "new")
                    xn = g.rows[keep].to(rows)
                    # the metric's moment in float64 (its Cholesky factor needs every digit), the
                    # query refit's normal equations in the rows' dtype (their ridge dwarfs the rest)
                    xo64 = xo.to(f64)
                    add_moment(s_oo, xo64, xo64)
                    xo = xo.to(rows)
                    add_moment(s_on, xo, xn)
                    add_moment(s_nn, xn, xn)
                    n_rows += xo.shape[0]
                    del xo, xn, xo64
                    ctx.done(sl)
            finally:
                g.remove()
        if n_rows == 0:
            raise GqakitError("no calibration rows left for the fits: lower skip_first or holdout, or pass "
                              "more --calibration-tokens")
        for m in (s_oo, s_on, s_nn):
            m /= n_rows
        return metric_factor(s_oo.cpu()), s_on.cpu(), s_nn.cpu()

    def _fit_heads(self, ctx: BlockContext, whiten: Tensor, s_on: Tensor, s_nn: Tensor) -> AttnHeads:
        """2.-3. grouping, alignment, pooling and the query refit, on the CPU in float64."""
        spec, shape, G = ctx.spec, ctx.shape, ctx.num_kv_heads
        src_t = ctx.block.source_attention()
        heads = read_heads(spec, shape, src_t, ctx.layer, dtype=torch.float64)
        h = regroup(heads, GROUPINGS[self.grouping](heads, G, rotary_style=spec.rotary.style,
                                                     rotary_dim=shape.rotary_dim, whiten=whiten))
        del heads, src_t
        q_ridge = float(self.opts.q_ridge)
        return aligned_mean(h, G, rotary_style=spec.rotary.style, rotary_dim=shape.rotary_dim, whiten=whiten,
                            s_ab=s_on, s_bb=s_nn, q_ridge=q_ridge if q_ridge >= 0 else None)

    def _fit_o_proj(self, ctx: BlockContext, pooled: AttnHeads) -> tuple[AttnHeads, dict[str, Tensor]]:
        """4. o_proj's float64 normal equations on the converted block, towards the original
        residual stream after attention; advances the original stream one block on the way.
        Returns the final heads and their block weights."""
        blk = ctx.block
        D, f64, opts = ctx.hidden, torch.float64, self.opts
        converted = blk.weights(pooled)
        fit_o = float(opts.o_ridge) >= 0
        H_D = pooled.o.shape[1] * pooled.o.shape[2]
        zz = torch.zeros(H_D, H_D, dtype=f64, device=self.device) if fit_o else None
        zt = torch.zeros(H_D, pooled.o.shape[0], dtype=f64, device=self.device) if fit_o else None
        o_bias = blk.o_bias()
        rd = self.rows_dtype
        # the attention loss's steps take the same target and row weights, on every row of each span
        keep_targets = bool(self.steps_at[ctx.layer]) and opts.loss == "attention"
        self.targets = {}
        with torch.inference_mode():
            for sl in ctx.passes:
                keep = ctx.masks(sl)[0]
                rows = slice(None) if keep_targets else keep
                blk.use(blk.original)
                ro = ctx.streams.get("orig", sl, self.dtype)
                grab_out = Grab(blk.o_mod, output=True)
                try:
                    ro_next = blk.run(sl, ro)
                finally:
                    grab_out.remove()
                if fit_o or keep_targets:  # the targets and row weights, in the rows' dtype
                    out_o = grab_out.rows[rows].to(rd)
                    ro_rows = ro.reshape(-1, D)[rows].to(rd)
                    target = out_o
                    if opts.target == "residual":
                        rn_rows = ctx.streams.get("new", sl, self.dtype).reshape(-1, D)[rows].to(rd)
                        target = target + (ro_rows - rn_rows)
                    if opts.row_weight == "relative":
                        post = ro_rows + out_o
                        w = (1.0 / post.pow(2).mean(dim=1).clamp_min(1e-30)).sqrt().unsqueeze(1)
                    else:
                        w = torch.ones(out_o.shape[0], 1, dtype=rd, device=self.device)
                    if keep_targets:
                        # kept where and as the streams are, by span: a third stream, while the layer's steps last
                        st, T = ctx.streams, ro.shape[1]
                        for s in ctx.spans_in(sl):
                            at = slice((s.start - sl.start) * T, (s.stop - sl.start) * T)
                            self.targets[s.start] = (target[at].to(device=st.orig.device, dtype=st.dtype),
                                                     w[at].squeeze(1).to(device=st.orig.device, dtype=torch.float32))
                        target, w = target[keep], w[keep]
                if fit_o:
                    if o_bias is not None:
                        target = target - o_bias.to(rd)
                    blk.use(converted)
                    g = Grab(blk.o_mod, stop=True)
                    try:
                        blk.run(sl, "new")
                    finally:
                        g.remove()
                    z = blk.in_head_order(g.rows[keep], pooled).to(rd) * w
                    add_product(zz, z, z)
                    add_product(zt, z, target * w)
                    del z, target, w
                ctx.advance_original(sl, ro_next)
                ctx.done(sl)
        if fit_o:
            pooled = pooled.replace(o=refit_o_proj_moments(zz.cpu(), zt.cpu(), pooled.o, float(opts.o_ridge)))
            converted = blk.weights(pooled)
        return pooled, converted

    def _o_after_steps(self, ctx: BlockContext, loss_on: SpanLoss, pooled: AttnHeads, current: dict[str, Tensor],
                       spans: list[slice]) -> Tensor:
        """o_proj refitted as in `_fit_o_proj`, on the attention outputs of the trained q, k, v (as the
        steps compute them) towards the targets the attention loss kept, ridge towards the trained o."""
        blk, f64, rd = ctx.block, torch.float64, self.rows_dtype
        heads = pooled.replace(**{p: current[p] for p in ("q", "k", "v")})
        H_D, out = current["o"].shape[1] * current["o"].shape[2], current["o"].shape[0]
        zz = torch.zeros(H_D, H_D, dtype=f64, device=self.device)
        zt = torch.zeros(H_D, out, dtype=f64, device=self.device)
        o_bias = blk.o_bias()
        g = Grab(blk.o_mod)  # o_proj's input; the attention loss's own hook stops the block after it
        try:
            with torch.no_grad():
                for sl in spans:
                    loss_on(sl, 0, current)
                    keep = ctx.masks(sl)[0]
                    target, w = (a.to(device=self.device, dtype=rd)[keep] for a in loss_on.targets_of(sl))
                    if o_bias is not None:
                        target = target - o_bias.to(rd)
                    w = w.unsqueeze(1)
                    z = blk.in_head_order(g.rows[keep], heads).to(rd) * w
                    add_product(zz, z, z)
                    add_product(zt, z, target * w)
                    ctx.done(sl)
        finally:
            g.remove()
        o = current["o"].detach().to(f64).cpu()
        return refit_o_proj_moments(zz.cpu(), zt.cpu(), o, float(self.opts.o_ridge)).to(
            device=current["o"].device, dtype=current["o"].dtype)

    def _reconstruct(self, ctx: BlockContext, pooled: AttnHeads) -> tuple[AttnHeads, dict[str, Tensor]]:
        """4b. block-wise reconstruction (BRECQ / AutoRound style): `steps` Adam steps on the
        converted block's attention weights (q, k, v, o and their biases; K/V shared by each
        group, everything else in the block frozen), minimising the relative squared error
        between the block's output on the converted stream and the original block's output
        on the original stream (which `_fit_o_proj` has just advanced; with `loss` =
        "attention", the o_proj refit's objective on the targets it kept), one span of `batch`
        sequences per step, each span once per epoch in a fresh random order (`span_order`).
        Each tensor's learning rate is `lr` times its RMS, decaying linearly to 0 over the
        steps. The steps are seeded by (seed, layer), so a resumed run takes the same ones. A
        guard keeps the best of the closed-form start and the weights at `guard_checks` evenly
        spaced steps, by the loss on the last `guard_spans` spans' measured rows (the held-out
        sequences when `holdout` > 0); with `patience` > 0 the layer's steps stop once that
        many guard evaluations in a row have not improved on the best (`EarlyStop`)."""
        blk, opts, L = ctx.block, self.opts, ctx.layer
        steps = self.steps_at[L]
        # the steps compute in `step_dtype`: bfloat16 is autocast, over float32 weights and streams
        autocast = opts.step_dtype == "bfloat16"
        sd = torch.float32 if autocast else getattr(torch, opts.step_dtype)
        parts = [p for p in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias") if getattr(pooled, p) is not None]
        params = {p: getattr(pooled, p).detach().to(device=self.device, dtype=sd).clone().requires_grad_()
                  for p in parts}
        rest = blk.rest_names() if self.block_at[L] else []
        for r in rest:  # the block's other weights, by their name in the block ("mlp.up_proj.weight")
            params[r] = blk.block.get_parameter(r).detach().to(sd).clone().requires_grad_()
        groups = [{"params": [t], "lr": float(opts.lr) * max(float(t.detach().pow(2).mean().sqrt()), 1e-12)}
                  for t in params.values()]
        # PyTorch's fused kernel where it has one (CPU, CUDA): one pass over each tensor and its moments,
        # where the default per-op loop makes about ten (docs/benchmarks-convert.md)
        fused = torch.device(self.device).type in ("cpu", "cuda") or None
        optim = torch.optim.Adam(groups, fused=fused)
        # the learning rate decays linearly to zero over the steps (as AutoRound's does)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda i: 1.0 - i / steps)
        loss_on = SpanLoss(ctx, pooled, parts, rest, sd=sd, autocast=autocast, device=self.device,
                           targets=self.targets if opts.loss == "attention" else None)
        fit = [sl for sl in ctx.spans if bool(ctx.masks(sl)[0].any())]
        guard = [sl for sl in ctx.spans[-int(opts.guard_spans):] if bool(ctx.masks(sl)[1].any())]

        def guard_loss(cur: dict[str, Tensor] | None = None) -> float:
            with torch.no_grad():
                cur = cur if cur is not None else {p: t.detach() for p, t in params.items()}
                return sum(float(loss_on(sl, 1, cur)) for sl in guard) / max(len(guard), 1)

        best_params = {p: t.detach().clone() for p, t in params.items()}
        gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + L)
        checks = check_steps(steps, int(opts.guard_checks))
        done, took_o = 0, False
        with loss_on.installed():
            stop = EarlyStop(guard_loss(), int(opts.patience))
            for step, i in enumerate(span_order(len(fit), steps, gen), start=1):
                with torch.enable_grad():
                    loss = loss_on(fit[i], 0, params)
                    optim.zero_grad(set_to_none=True)
                    loss.backward()
                optim.step()
                sched.step()
                ctx.tick(1)
                done = step
                if step in checks:
                    g = guard_loss()
                    if stop.update(g, step):
                        best_params = {p: t.detach().clone() for p, t in params.items()}
                    ctx.note(f"reconstruction loss {float(loss.detach()):.4f}, guard {g:.4f}")
                    if stop.stop:
                        if step < steps:
                            ctx.tick(steps - step)  # the steps left are not taken
                        break
            final_o = self.final_at[L]
            if final_o:  # o_proj's closed form on the best q, k, v, kept where the guard prefers it
                passes = [sl for sl in ctx.passes if bool(ctx.masks(sl)[0].any())]
                cand = {**best_params, "o": self._o_after_steps(ctx, loss_on, pooled, best_params, passes)}
                g = guard_loss(cand)
                ctx.note(f"o_proj refit after the steps: guard {g:.4f}")
                took_o = stop.update(g, done)
                if took_o:
                    best_params = cand
        best, best_at = stop.best, stop.best_at
        self.recon.append({"layer": L, "guard_best": best, "best_step": best_at, "steps_taken": done}
                          | ({"final_o": took_o} if final_o else {}))
        del optim, sched, params, loss_on
        self.targets = {}
        for r in rest:  # the block keeps its trained weights for the converted stream and the writer
            blk.block.get_parameter(r).data = best_params.pop(r).to(self.dtype)
        pooled = pooled.replace(**{p: t.to(getattr(pooled, p).dtype).cpu() for p, t in best_params.items()})
        return pooled, blk.weights(pooled)
