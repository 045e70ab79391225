"""Calibrated conversion (`align-refit`): a training-free, closed-form pass over the whole model.

Runs once before the pipeline's per-layer pass (`methods.PREPARE`) and returns every
layer's final heads. Layer by layer, in order:

  1. inputs: the original model's attention input x (and its residual stream and
     attention output) on the calibration tokens, and the *converted-so-far* model's
     input x' to the same layer (earlier layers are already converted, so x' drifts);
  2. grouping (optional, by aligned-weight similarity in the input metric), then
     RoPE-aware alignment in the metric of E[x x^T], then mean pooling;
  3. query refit: per query head, the RoPE-commuting map (scaled 2x2 rotation per
     frequency pair, full matrix on unrotated dims) that best reproduces its original
     keys k_j(x) from the pooled keys k'(x'), by ridge least squares on the moments
     E[x~ x~'^T], E[x~' x~'^T];
  4. o_proj refit: ridge least squares of o_proj on the converted layer's per-head
     attention outputs, towards the original model's residual stream after this
     attention (original attention output + original residual - converted residual), so
     each layer also corrects the drift of the layers before it.

Options (`settings.options`: Python API and bench --options; no CLI flag): seq_len, q_ridge, o_ridge (ridge strength,
relative to the mean diagonal of the normal matrix; < 0 skips that refit), target
("residual" | "local"), skip_first (leave the first n positions of every sequence out of
the fits), row_weight ("relative": each row of the o_proj fit weighted by 1/|original
residual|^2, so rows with outsized "attention sink" activations, e.g. SmolLM2's first
position at ~25,000 against ~150 elsewhere, do not dominate it; "none"), holdout (a
fraction of the sequences kept out of the fits; the reported `residual_drift` is then
measured on them). The o_proj fit has (heads x head_dim)^2 free values per layer and
overfits a few thousand tokens: its default ridge (3e-2) is set by held-out drift on
SmolLM2.

Calibration text is `--calibration-data` (tokenised, cut into sequences) or, without
it, text sampled from the source model itself (offline, no extra input).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from gqakit.convert import arch as archmod
from gqakit.convert.align import (align_heads, expand_kv, pool_mean, refit_o_proj, refit_queries)
from gqakit.convert.layout import AttnHeads, layer_names, read_heads, write_heads
from gqakit.convert.pooling import PoolContext, contiguous_groups, regroup
from gqakit.core.errors import GqakitError

DEFAULTS = {"seq_len": 256, "q_ridge": 1e-2, "o_ridge": 3e-2, "target": "residual", "sample_batch": 64, "skip_first": 0,
            "row_weight": "relative", "holdout": 0.0, "dtype": "auto"}


def source_path(opened: Any) -> Path:
    return Path(opened.folder) / opened.gguf if opened.gguf else Path(opened.folder)


def _bos_id(model: Any, tokenizer: Any = None) -> int:
    for obj in (tokenizer, getattr(model, "generation_config", None), model.config):
        tid = getattr(obj, "bos_token_id", None) if obj is not None else None
        if tid is not None:
            return int(tid)
    eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0]
    if eos is None:
        raise GqakitError("cannot sample calibration text: the model has neither a BOS nor an EOS token; "
                          "pass --calibration-data FILE")
    return int(eos)


def calibration_batches(model: Any, path: Path, data: str | None, tokens: int, seq_len: int, seed: int,
                        batch: int = 16, progress: bool = True) -> tuple[list[Tensor], str]:
    """Token batches [B, seq_len] and a description of where they came from."""
    max_pos = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    seq_len = min(seq_len, int(max_pos)) if max_pos else seq_len
    n_seq = max(1, math.ceil(tokens / seq_len))
    if data:
        from gqakit.core.loading import load_tokenizer

        p = Path(data).expanduser()
        if not p.is_file():
            raise GqakitError(f"calibration data not found: {p}")
        text = p.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        tok = load_tokenizer(path)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        bos = _bos_id(model, tok)
        body = seq_len - 1
        if len(ids) < body:
            raise GqakitError(f"calibration data {p} has {len(ids)} tokens, fewer than one sequence of {seq_len}")
        n_seq = min(n_seq, len(ids) // body)
        seqs = torch.tensor([[bos] + ids[i * body:(i + 1) * body] for i in range(n_seq)], dtype=torch.long)
        where = f"{p} ({n_seq} x {seq_len} tokens)"
    else:
        bos = _bos_id(model)
        out = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for i in tqdm(range(0, n_seq, batch), desc="sampling calibration text", disable=not progress):
                b = min(batch, n_seq - i)
                start = torch.full((b, 1), bos, dtype=torch.long)
                gen = model.generate(start, attention_mask=torch.ones_like(start), do_sample=True, top_k=0,
                                     top_p=1.0, temperature=1.0, max_new_tokens=seq_len - 1,
                                     min_new_tokens=seq_len - 1, pad_token_id=bos)
                out.append(gen[:, :seq_len])
        seqs = torch.cat(out)
        where = f"sampled from the source model ({n_seq} x {seq_len} tokens, seed {seed})"
    return [seqs[i:i + batch] for i in range(0, len(seqs), batch)], where


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


def prepare_refit(opened: Any, plan: Any, settings: Any) -> dict[str, Any]:
    """Every layer's converted heads, computed sequentially on calibration data."""
    from gqakit.convert import methods
    from gqakit.core.loading import load_causal_lm

    opts = {**DEFAULTS, **(settings.options or {})}
    t0 = time.perf_counter()
    path = source_path(opened)
    spec = archmod.registry()[plan.family]
    shape = plan.shape
    G, KV = settings.num_kv_heads, shape.num_kv_heads
    probe = load_causal_lm(path, dtype=torch.float32)
    n_params = sum(p.numel() for p in probe.parameters())
    dtype = {"float32": torch.float32, "float64": torch.float64}.get(
        opts["dtype"], torch.float64 if n_params < 20_000_000 else torch.float32)
    progress = bool(opts.get("progress", True))
    with torch.inference_mode():  # sampling in float32: float64 matmuls are several times slower on CPU
        batches, where = calibration_batches(probe, path, settings.calibration_data, settings.calibration_tokens,
                                             int(opts["seq_len"]), settings.seed, int(opts["sample_batch"]), progress)
    model = probe if dtype == torch.float32 else probe.to(dtype)
    model.eval()
    a = spec.attention
    pre = [a.prefix.format(layer=L) for L in range(shape.num_layers)]
    block_names = [p[:-1].rsplit(".", 1)[0] for p in pre]
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
            for b in tqdm(batches, desc="calibration pass", disable=not progress):
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
    group_fn = methods.GROUPINGS[settings.grouping]
    sd = model.state_dict()
    resid_new = [r.clone() for r in resid_orig[0]]
    final: dict[int, AttnHeads] = {}
    drift: list[float] = []        # mean relative error of the residual stream per row (kept rows)
    drift_first: list[float] = []  # the same at the first position
    for L in tqdm(range(L_n), desc="refitting layers", disable=not progress):
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
        ctx = PoolContext(G, contiguous_groups(KV, G), spec.rotary.style, shape.rotary_dim, L, None,
                          {"whiten": whiten})
        groups = group_fn(heads, ctx)
        h = regroup(heads, groups)
        al = align_heads(h, G, rotary_style=spec.rotary.style, rotary_dim=shape.rotary_dim, whiten=whiten)
        pooled = pool_mean(al, G)
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
    return {"layers": final, "calibration": where, "prepare_seconds": time.perf_counter() - t0,
            "residual_drift": drift, "residual_drift_first": drift_first}
