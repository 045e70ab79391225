"""The in-memory `align-refit` calibration that the layer-streamed stage replaced, kept only
as the reference that tests compare the streamed implementation against.

It loads the whole model, runs one forward pass with hooks that keep every layer's inputs,
residual streams and attention outputs for all calibration tokens at once, then refits the
layers in order. `convert/calibration/` computes the same fits one decoder block at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gqakit.core import arch as archmod
from gqakit.convert.align import align_heads, expand_kv, refit_o_proj, refit_queries
from gqakit.convert.layout import AttnHeads, layer_names, read_heads, write_heads
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.pooling import pool_contiguous, regroup


class _Stop(Exception):
    pass


def _hidden_arg(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, hidden: Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _aug(x: Tensor) -> Tensor:
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)


def reference_refit(opened: Any, plan: Any, settings: Any, batches: list[Tensor], options: dict) -> dict[str, Any]:
    """Every layer's converted heads, computed sequentially on calibration `batches` [B, T]."""
    from gqakit.core.loading import load_causal_lm

    opts = options
    path = opened.folder / opened.gguf if opened.gguf else opened.folder
    spec = archmod.registry()[plan.family]
    shape = plan.shape
    G, KV = settings.num_kv_heads, shape.num_kv_heads
    probe = load_causal_lm(path, dtype=torch.float32)
    n_params = sum(p.numel() for p in probe.parameters())
    dtype = {"float32": torch.float32, "float64": torch.float64}.get(
        opts["dtype"], torch.float64 if n_params < 20_000_000 else torch.float32)
    model = probe if dtype == torch.float32 else probe.to(dtype)
    model.eval()
    a = spec.attention
    pre = [a.prefix.format(layer=L) for L in range(shape.num_layers)]
    block_names = [spec.block_name(L) for L in range(shape.num_layers)]
    in_names = [p + (a.q or a.qkv) for p in pre]
    o_names = [p + a.o for p in pre]
    L_n = shape.num_layers
    saved: list[list[tuple[tuple, dict]]] = [[] for _ in range(L_n)]
    resid_orig: list[list[Tensor]] = [[] for _ in range(L_n)]
    x_orig: list[list[Tensor]] = [[] for _ in range(L_n)]
    out_orig: list[list[Tensor]] = [[] for _ in range(L_n)]
    hooks = []
    for L in range(L_n):
        def block_hook(mod, args, kwargs, L=L):
            saved[L].append((args, kwargs))
            resid_orig[L].append(_hidden_arg(args, kwargs).detach().clone())

        def in_hook(mod, args, L=L):
            x_orig[L].append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())

        def out_hook(mod, args, out, L=L):
            out_orig[L].append(out.detach().reshape(-1, out.shape[-1]).clone())

        hooks.append(model.get_submodule(block_names[L]).register_forward_pre_hook(block_hook, with_kwargs=True))
        hooks.append(model.get_submodule(in_names[L]).register_forward_pre_hook(in_hook))
        hooks.append(model.get_submodule(o_names[L]).register_forward_hook(out_hook))
    try:
        with torch.inference_mode():
            body = getattr(model, "base_model", None) or model  # the decoder only: no logits needed
            for b in batches:
                body(input_ids=b, use_cache=False)
    finally:
        for h in hooks:
            h.remove()

    # rows used in the fits: options {"skip_first": n} leaves out the first n positions of each
    # sequence (BOS often carries outsized "attention sink" activations that can dominate a fit)
    skip = int(opts["skip_first"])
    keep = torch.cat([(torch.arange(b.shape[1]) >= skip).repeat(b.shape[0]) for b in batches])
    # options {"holdout": f}: the last fraction f of the sequences is left out of the fits and only
    # measures the residual drift (a generalisation check); otherwise drift is measured in-sample
    seq_id = torch.cat([torch.arange(b.shape[0]).repeat_interleave(b.shape[1]) + sum(x.shape[0] for x in batches[:i])
                        for i, b in enumerate(batches)])
    n_seq = sum(b.shape[0] for b in batches)
    n_hold = min(n_seq - 1, int(round(float(opts["holdout"]) * n_seq)))
    held = seq_id >= n_seq - n_hold
    measure = (keep & held) if n_hold else keep
    first = torch.cat([(torch.arange(b.shape[1]) == 0).repeat(b.shape[0]) for b in batches])
    measure_first = (first & held) if n_hold else first
    keep = keep & ~held
    group_fn = GROUPINGS[settings.grouping]
    sd = model.state_dict()
    resid_new = [r.clone() for r in resid_orig[0]]
    final: dict[int, AttnHeads] = {}
    drift: list[float] = []        # mean relative error of the residual stream per row (kept rows)
    drift_first: list[float] = []  # the same at the first position
    for L in range(L_n):
        block = model.get_submodule(block_names[L])

        def run(capture: str | None, stop: bool = False) -> list[Tensor]:
            got: list[Tensor] = []
            name = in_names[L] if capture == "in" else o_names[L]
            hook = None
            if capture:
                def grab(mod, args):
                    got.append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())
                    if stop:
                        raise _Stop

                hook = model.get_submodule(name).register_forward_pre_hook(grab)
            outs = []
            try:
                with torch.inference_mode():
                    for (args, kwargs), hid in zip(saved[L], resid_new):
                        a2, k2 = _with_hidden(args, kwargs, hid)
                        try:
                            o = block(*a2, **k2)
                        except _Stop:
                            continue
                        outs.append((o[0] if isinstance(o, tuple) else o).detach().clone())
            finally:
                if hook is not None:
                    hook.remove()
            return got if capture else outs

        xo = torch.cat(x_orig[L]).double()[keep]
        xn = torch.cat(run("in", stop=True)).double()[keep]
        n = xo.shape[0]
        xo_a, xn_a = _aug(xo), _aug(xn)
        s_oo = xo_a.T @ xo_a / n
        s_on = xo_a.T @ xn_a / n
        s_nn = xn_a.T @ xn_a / n
        eye = torch.eye(s_oo.shape[0], dtype=torch.float64)
        whiten = torch.linalg.cholesky(s_oo + 1e-8 * float(torch.diagonal(s_oo).mean()) * eye)

        names = layer_names(spec, L)
        tensors = {nm: sd[nm] for nm in names.values() if nm in sd}
        dtypes = {nm: t.dtype for nm, t in tensors.items()}
        heads = read_heads(spec, shape, tensors, L, dtype=torch.float64)
        groups = group_fn(heads, G, rotary_style=spec.rotary.style, rotary_dim=shape.rotary_dim, whiten=whiten)
        h = regroup(heads, groups)
        al = align_heads(h, G, rotary_style=spec.rotary.style, rotary_dim=shape.rotary_dim, whiten=whiten)
        pooled = pool_contiguous(al, G, "mean")
        if float(opts["q_ridge"]) >= 0:
            pooled = refit_queries(al, pooled, rotary_style=spec.rotary.style, rotary_dim=shape.rotary_dim,
                                   s_ab=s_on, s_bb=s_nn, ridge=float(opts["q_ridge"]))

        def put(hd: AttnHeads) -> None:
            for nm, t in write_heads(spec, expand_kv(hd, KV), L, dtypes).items():
                sd[nm].copy_(t)

        put(pooled)
        if float(opts["o_ridge"]) >= 0:
            z = torch.cat(run("o")).double()[keep]
            target = torch.cat(out_orig[L]).double()[keep]
            if opts["target"] == "residual":
                ro = torch.cat([r.reshape(-1, r.shape[-1]) for r in resid_orig[L]]).double()
                rn = torch.cat([r.reshape(-1, r.shape[-1]) for r in resid_new]).double()
                target = target + (ro - rn)[keep]
            o_bias = sd.get(names["o.weight"][: -len("weight")] + "bias")
            if opts["row_weight"] == "relative":
                # each row's error relative to the original residual stream after this attention:
                # the next layer reads it through a norm, so only its relative error matters, and
                # rows with outsized activations (the first position's "attention sink") no
                # longer dominate the fit
                post = torch.cat([r.reshape(-1, r.shape[-1]) for r in resid_orig[L]]).double()[keep]
                post = post + torch.cat(out_orig[L]).double()[keep]
                w = 1.0 / post.pow(2).mean(dim=1).clamp_min(1e-30)
                w = (w / w.mean()).sqrt().unsqueeze(1)
            else:
                w = torch.ones(z.shape[0], 1, dtype=z.dtype)
            if o_bias is not None:
                target = target - o_bias.double()
            pooled = pooled.replace(o=refit_o_proj(z * w, target * w, pooled.o, float(opts["o_ridge"])))
            put(pooled)
        resid_new = run(None)
        final[L] = pooled
        if L + 1 < L_n:  # drift of the residual stream entering the next layer (kept rows), for the record
            ro = torch.cat([r.reshape(-1, r.shape[-1]) for r in resid_orig[L + 1]]).double()
            rn = torch.cat([r.reshape(-1, r.shape[-1]) for r in resid_new]).double()
            rel = (rn - ro).norm(dim=1) / ro.norm(dim=1).clamp_min(1e-30)
            drift.append(float(rel[measure].mean()))
            drift_first.append(float(rel[measure_first].mean()))
    return {"layers": final, "residual_drift": drift, "residual_drift_first": drift_first}
