"""Alignment, pooling and least-squares restoration of attention heads: pure tensor math.

Everything here works on canonical `AttnHeads` (layout.py) whose groups are already
contiguous (`pooling.regroup`), so KV head j belongs to group j // s (s = KV / G) and
query head i reads KV head i // r (r = H / KV).

Function-preserving transforms (`align_heads`):
  * K side: each KV head j is multiplied by an orthogonal matrix R_j that commutes with
    the rotary embedding: an independent 2x2 rotation in each rotary frequency pair
    (rotate-half pairs dim i with i + rotary_dim/2, interleaved pairs 2i with 2i+1) and
    any orthogonal matrix on the non-rotary dims (partial rotary, or no rotary at all).
    The query heads that read j get the same R_j, so every logit q.k is unchanged at
    every pair of positions: (Rot_m R q).(Rot_n R k) = q.(Rot_m^T Rot_n) k.
  * V side: V_j -> U_j V_j with any orthogonal U_j, and o_proj's columns of every query
    head reading j -> o_h U_j^T.
  R_j and U_j are chosen by generalised Procrustes: each head of a group is rotated
  towards the group's mean (iterated), in the metric of the layer input's second moment
  (identity when there is no data). See Align Attention Heads Before Merging Them
  (arXiv 2412.20677). Heads that are already identical stay identical, so exact
  conversions stay exact.

Restoration after pooling (`refit_queries`, `refit_outputs_local`): each query head h
that used to read K_j now reads the pooled head K'. We fit the transform M_h that best
maps the pooled key onto the original one, k_j ~ M_h k', and give the query M_h^T, so
q.k_j ~ (M_h^T q).k'. M_h must commute with RoPE: per frequency pair a scaled rotation
[[a, -b], [b, a]] (which both restores the logit scale lost by averaging and removes the
residual phase), a full matrix on non-rotary dims. The same fit on the V side gives
o_h -> o_h M_h. With moments from calibration data these are ridge least-squares fits
on real activations; without data the weights' own metric (identity) is used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gqakit.convert.layout import AttnHeads


# ----------------------------------------------------------------------------- rotary structure

def rotary_pairs(head_dim: int, rotary_dim: int, style: str) -> tuple[Tensor, Tensor, Tensor]:
    """(first, second, free): index tensors of each rotary pair's two dims, and the unrotated dims."""
    if style == "none" or rotary_dim <= 0:
        e = torch.zeros(0, dtype=torch.long)
        return e, e, torch.arange(head_dim)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
    if style == "rotate_half":
        a = torch.arange(rotary_dim // 2)
        b = a + rotary_dim // 2
    elif style == "interleaved":
        a = torch.arange(0, rotary_dim, 2)
        b = a + 1
    else:
        raise ValueError(f"unknown rotary style {style!r}")
    return a, b, torch.arange(rotary_dim, head_dim)


def _augment(w: Tensor, b: Tensor | None) -> Tensor:
    """[n, D, in] weights and [n, D] bias -> [n, D, in + 1] (bias as the last input column)."""
    col = torch.zeros(*w.shape[:-1], 1, dtype=w.dtype) if b is None else b.unsqueeze(-1)
    return torch.cat([w, col], dim=-1)


def _split(aug: Tensor, has_bias: bool) -> tuple[Tensor, Tensor | None]:
    return aug[..., :-1], (aug[..., -1] if has_bias else None)


# ----------------------------------------------------------------------------- activation moments

def add_moment(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += [a 1]^T [b 1] in place, without building the augmented copies. Rows narrower than
    `acc` are multiplied and summed in their own dtype, then added in `acc`'s (`add_product`)."""
    D = a.shape[1]
    add_product(acc[:D, :D], a, b)
    acc[:D, D] += a.sum(0, dtype=acc.dtype)
    acc[D, :D] += b.sum(0, dtype=acc.dtype)
    acc[D, D] += a.shape[0]


def add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a^T b. A batch's product is computed in the rows' dtype (float32 rows: the sum over
    one batch's rows is float32's, a relative error of about 1e-7 x sqrt(rows), far below the
    fits' ridge) and accumulated across batches in `acc`'s dtype (float64)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a.T, b)
    else:
        acc += (a.T @ b).to(acc.dtype)


def metric_factor(moment: Tensor) -> Tensor:
    """The Cholesky factor of a second moment E[x~ x~^T], with a 1e-8 relative jitter on its
    diagonal (the `whiten` metric of alignment and similarity grouping)."""
    m = moment.clone()
    m.diagonal().add_(1e-8 * float(torch.diagonal(m).mean()))
    return torch.linalg.cholesky(m)


# ----------------------------------------------------------------------------- Procrustes

def _fit_rope_rotation(n: Tensor, pairs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """The orthogonal, RoPE-commuting R maximising tr(R n) for a cross moment n = A B^T [D, D]."""
    a, b, free = pairs
    D = n.shape[0]
    r = torch.zeros(D, D, dtype=n.dtype)
    if len(a):
        theta = torch.atan2(n[a, b] - n[b, a], n[a, a] + n[b, b])
        c, s = torch.cos(theta), torch.sin(theta)
        r[a, a], r[a, b], r[b, a], r[b, b] = c, -s, s, c
    if len(free):
        r[free.unsqueeze(1), free] = _fit_orthogonal(n[free.unsqueeze(1), free])
    return r


def _fit_orthogonal(n: Tensor) -> Tensor:
    """The orthogonal R maximising tr(R n) (Procrustes; polar factor of n^T)."""
    u, _, vt = torch.linalg.svd(n)
    return vt.transpose(-1, -2) @ u.transpose(-1, -2)


def procrustes_group(x: Tensor, fit, iters: int = 8) -> Tensor:
    """Rotations R [s, D, D] that bring the heads x [s, D, m] (already whitened) to a common frame.

    Generalised Procrustes: start from the head with the largest norm as reference,
    then alternate (rotate each head to the reference; reference = mean of the rotated
    heads) until it settles.
    """
    s = x.shape[0]
    ref = x[int(x.pow(2).sum(dim=(1, 2)).argmax())]
    rs = torch.eye(x.shape[1], dtype=x.dtype).expand(s, -1, -1).clone()
    for _ in range(iters):
        rs = torch.stack([fit(x[j] @ ref.T) for j in range(s)])
        new_ref = (rs @ x).mean(dim=0)
        if torch.allclose(new_ref, ref, rtol=0, atol=1e-12 * (1 + ref.abs().max().item())):
            break
        ref = new_ref
    return rs


def align_heads(h: AttnHeads, num_groups: int, *, rotary_style: str, rotary_dim: int,
                whiten: Tensor | None = None, iters: int = 8) -> AttnHeads:
    """Rotate each KV head into its group's frame; function-preserving (no pooling here).

    `whiten` is a factor L of the augmented input second moment (Sigma = L L^T, shape
    [in + 1, in + 1]); None means the identity metric (weights only, no data).
    """
    KV, D = h.num_kv_heads, h.k.shape[1]
    s, r = KV // num_groups, h.num_heads // KV
    pairs = rotary_pairs(D, rotary_dim, rotary_style)
    ka, va = _augment(h.k, h.k_bias), _augment(h.v, h.v_bias)
    kw, vw = (ka, va) if whiten is None else (ka @ whiten, va @ whiten)
    eye = torch.eye(D, dtype=h.k.dtype)
    rk = eye.expand(KV, D, D).clone()
    rv = eye.expand(KV, D, D).clone()
    # a norm's per-dim weight between a projection and the rotary embedding does not commute
    # with a rotation of its dims: such heads keep their K frame (V still aligns)
    rotate_k = h.q_norm is None and h.k_norm is None
    for g in range(num_groups if s > 1 else 0):  # groups of one head stay as they are
        sl = slice(g * s, (g + 1) * s)
        if rotate_k:
            rk[sl] = procrustes_group(kw[sl], lambda n: _fit_rope_rotation(n, pairs), iters)
        rv[sl] = procrustes_group(vw[sl], _fit_orthogonal, iters)
    k, kb = _split(rk @ ka, h.k_bias is not None)
    v, vb = _split(rv @ va, h.v_bias is not None)
    rq = rk.repeat_interleave(r, dim=0)                      # [H, D, D]: each query head's KV rotation
    q = rq @ h.q
    qb = None if h.q_bias is None else (rq @ h.q_bias.unsqueeze(-1)).squeeze(-1)
    rvq = rv.repeat_interleave(r, dim=0)
    o = torch.einsum("ohd,hed->ohe", h.o, rvq)              # o_h U^T
    return AttnHeads(q=q, k=k, v=v, o=o, q_bias=qb, k_bias=kb, v_bias=vb, q_norm=h.q_norm, k_norm=h.k_norm,
                     q_order=h.q_order)


def expand_kv(h: AttnHeads, num_kv_heads: int) -> AttnHeads:
    """Repeat pooled heads so there are `num_kv_heads` again (the same function, MHA-shaped)."""
    rep = num_kv_heads // h.num_kv_heads
    f = lambda t: None if t is None else t.repeat_interleave(rep, dim=0)  # noqa: E731
    return h.replace(k=f(h.k), v=f(h.v), k_bias=f(h.k_bias), v_bias=f(h.v_bias), k_norm=f(h.k_norm))


# ----------------------------------------------------------------------------- restoration

def fit_rope_map(c_ab: Tensor, c_bb: Tensor, pairs: tuple[Tensor, Tensor, Tensor], ridge: float) -> Tensor:
    """The RoPE-commuting M minimising E|a - M b|^2 + lam |M - I|^2, from moments.

    c_ab = E[a b^T], c_bb = E[b b^T] ([D, D]). Per rotary pair M is [[x, -y], [y, x]];
    on free dims M is a full matrix. lam = ridge * mean(diag(c_bb)).
    """
    a, b, free = pairs
    D = c_bb.shape[0]
    lam = ridge * float(torch.diagonal(c_bb).mean()) + 1e-30
    m = torch.zeros(D, D, dtype=c_bb.dtype)
    if len(a):
        den = c_bb[a, a] + c_bb[b, b] + 2 * lam
        x = (c_ab[a, a] + c_ab[b, b] + 2 * lam) / den
        y = (c_ab[b, a] - c_ab[a, b]) / den
        m[a, a], m[a, b], m[b, a], m[b, b] = x, -y, y, x
    if len(free):
        fi = free.unsqueeze(1)
        m[fi, free] = fit_full_map(c_ab[fi, free], c_bb[fi, free], ridge)
    return m


def fit_full_map(c_ab: Tensor, c_bb: Tensor, ridge: float) -> Tensor:
    """M minimising E|a - M b|^2 + lam |M - I|^2: (c_ab + lam I)(c_bb + lam I)^-1."""
    n = c_bb.shape[0]
    lam = ridge * float(torch.diagonal(c_bb).mean()) + 1e-30
    eye = torch.eye(n, dtype=c_bb.dtype)
    return torch.linalg.solve(c_bb + lam * eye, (c_ab + lam * eye).T).T


def _moments(w_a: Tensor, w_b: Tensor, s_ab: Tensor | None, s_bb: Tensor | None) -> tuple[Tensor, Tensor]:
    """E[a b^T], E[b b^T] for a = w_a x~, b = w_b x~' (augmented inputs with those moments)."""
    if s_ab is None:
        return w_a @ w_b.T, w_b @ w_b.T
    return w_a @ s_ab @ w_b.T, w_b @ s_bb @ w_b.T


def refit_queries(aligned: AttnHeads, pooled: AttnHeads, *, rotary_style: str, rotary_dim: int,
                  s_ab: Tensor | None = None, s_bb: Tensor | None = None, ridge: float = 1e-3) -> AttnHeads:
    """Give each query head the RoPE-commuting map that makes its logits against the pooled
    key match those against its original (aligned) key; returns `pooled` with new q.

    s_ab = E[x~ x~'^T] (original-model input vs converted-model input, augmented with 1),
    s_bb = E[x~' x~'^T]; None: identity metric on the weights (no data).
    """
    H, KV, G = aligned.num_heads, aligned.num_kv_heads, pooled.num_kv_heads
    r, s = H // KV, KV // G
    pairs = rotary_pairs(aligned.k.shape[1], rotary_dim, rotary_style)
    ka = _augment(aligned.k, aligned.k_bias)
    kp = _augment(pooled.k, pooled.k_bias)
    maps = []
    for j in range(KV):
        c_ab, c_bb = _moments(ka[j], kp[j // s], s_ab, s_bb)
        maps.append(fit_rope_map(c_ab, c_bb, pairs, ridge))
    mq = torch.stack(maps).repeat_interleave(r, dim=0)      # [H, D, D]
    mt = mq.transpose(1, 2)
    q = mt @ pooled.q
    qb = None if pooled.q_bias is None else (mt @ pooled.q_bias.unsqueeze(-1)).squeeze(-1)
    return pooled.replace(q=q, q_bias=qb)


def refit_outputs_local(aligned: AttnHeads, pooled: AttnHeads, *, s_ab: Tensor | None = None,
                        s_bb: Tensor | None = None, ridge: float = 1e-3) -> AttnHeads:
    """o_h -> o_h M_j with M_j the least-squares map of the pooled value onto the original
    (aligned) value of head j; restores the value scale. Returns `pooled` with new o."""
    H, KV, G = aligned.num_heads, aligned.num_kv_heads, pooled.num_kv_heads
    r, s = H // KV, KV // G
    va = _augment(aligned.v, aligned.v_bias)
    vp = _augment(pooled.v, pooled.v_bias)
    maps = [fit_full_map(*_moments(va[j], vp[j // s], s_ab, s_bb), ridge) for j in range(KV)]
    mo = torch.stack(maps).repeat_interleave(r, dim=0)     # [H, D, D]
    return pooled.replace(o=torch.einsum("ohd,hde->ohe", pooled.o, mo))


def refit_o_proj(z: Tensor, target: Tensor, o: Tensor, ridge: float) -> Tensor:
    """o_proj [out, H, D] refit by ridge least squares: Z O^T ~ target, shrunk towards o.

    z: [N, H*D] inputs of o_proj (per-head attention outputs) after conversion; target:
    [N, out] what o_proj (without its bias) should output.
    """
    return refit_o_proj_moments(z.T @ z, z.T @ target, o, ridge)


def refit_o_proj_moments(zz: Tensor, zt: Tensor, o: Tensor, ridge: float) -> Tensor:
    """`refit_o_proj` from its normal equations Z^T Z [H*D, H*D] and Z^T target [H*D, out],
    which a streamed caller accumulates batch by batch. The ridge is relative to the mean
    diagonal of Z^T Z, so scaling every row weight by one constant changes nothing.
    Consumes `zz` and `zt` (overwritten in place: the solve needs no copies of them)."""
    out, H, D = o.shape
    lam = ridge * float(torch.diagonal(zz).mean()) + 1e-30
    zz.diagonal().add_(lam)
    rhs = zt.add_(o.reshape(out, H * D).T.to(zt.dtype), alpha=lam)
    sol = torch.linalg.solve(zz, rhs)
    return sol.T.reshape(out, H, D)


# ----------------------------------------------------------------------------- grouping

def head_distance(h: AttnHeads, *, rotary_style: str, rotary_dim: int, whiten: Tensor | None = None) -> Tensor:
    """[KV, KV] distance between KV heads after the best alignment of one onto the other
    (K with RoPE-commuting rotations, V with any orthogonal map), each side normalised."""
    KV, D = h.num_kv_heads, h.k.shape[1]
    pairs = rotary_pairs(D, rotary_dim, rotary_style)
    dist = torch.zeros(KV, KV, dtype=h.k.dtype)
    for w, b, fit in ((h.k, h.k_bias, lambda n: _fit_rope_rotation(n, pairs)), (h.v, h.v_bias, _fit_orthogonal)):
        x = _augment(w, b)
        if whiten is not None:
            x = x @ whiten
        x = x / x.pow(2).sum(dim=(1, 2), keepdim=True).sqrt().clamp_min(1e-30)
        for i in range(KV):
            for j in range(i + 1, KV):
                rot = fit(x[j] @ x[i].T)
                d = (rot @ x[j] - x[i]).pow(2).sum()
                dist[i, j] += d
                dist[j, i] += d
    return dist
