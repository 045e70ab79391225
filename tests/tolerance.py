"""Tolerances for comparing two floating-point computations of the same function.

Two implementations that differ only in the order of their floating-point operations (a
compiled kernel against the model's own step, a reassociated sum, the SIMD width ATen's CPU
dispatch picks on this processor) disagree by rounding alone. A sum of n products computed in
any order is within gamma_n * sum|x_i * y_i| of the exact value, gamma_n = n*u / (1 - n*u) ~ n*u,
with u the unit roundoff of the dtype (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., section 3.1); two orders are within twice that of each other. A network
chains such reductions, and to first order their errors add: the bound on an output is the
sum of the reduction lengths along its path (`path_length`), times u, times the magnitude the
sums work on (`scale`, the largest magnitude of the compared tensor, or 1 where activations are
normalised and the output is smaller).

This is a worst-case bound, not a fit to one machine: it holds whatever order a processor
chooses. It stays far below what a real bug costs: a wrong head, a position off by one or a
missing scale moves outputs by 1e-2 to 1e-1 of their magnitude, where these bounds are
around 1e-4 of it for the sizes the tests use.
"""

from __future__ import annotations

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11}


def rounding_tolerance(dtype: torch.dtype, path_length: int, scale: float = 1.0) -> float:
    """Largest gap between two evaluation orders of a chain of reductions whose lengths add to
    `path_length`, working on magnitudes up to `scale` (twice gamma_n: one bound for each order)."""
    u = UNIT_ROUNDOFF[dtype]
    n = max(int(path_length), 1)
    assert n * u < 0.5, "bound not meaningful: the reduction is too long for this dtype"
    return 2.0 * n * u / (1.0 - n * u) * max(float(scale), 1.0)


def assert_close_by_rounding(got: torch.Tensor, ref: torch.Tensor, path_length: int, msg: str = "") -> None:
    """`got` equals `ref` up to the rounding of `path_length` chained reduction terms, the
    magnitude taken from `ref`."""
    atol = rounding_tolerance(ref.dtype, path_length, float(ref.abs().max()) if ref.numel() else 1.0)
    torch.testing.assert_close(got, ref, rtol=0, atol=atol, msg=msg or None)


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    """|got - ref| <= bound, element by element (a bound per element, from its own terms)."""
    gap = (got.double() - ref.double()).abs()
    over = gap > bound.double()
    if bool(over.any()):
        i = int((gap - bound.double()).flatten().argmax())
        raise AssertionError(f"{what or 'values'}: {int(over.sum())} of {gap.numel()} elements beyond their rounding "
                             f"bound; worst at flat index {i}: gap {float(gap.flatten()[i]):.3g}, "
                             f"bound {float(bound.flatten()[i]):.3g}")


def linear_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Per output element of x W^T + b: twice gamma_(K+1) times the sum of its terms' magnitudes."""
    u, k = UNIT_ROUNDOFF[x.dtype], x.shape[-1] + 1
    terms = x.abs().double() @ w.abs().double().T + (0 if b is None else b.abs().double())
    return 2.0 * k * u / (1.0 - k * u) * terms


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None) -> torch.Tensor:
    """Per output element of one-token attention (q [B, H, 1, D], k/v [B, G, T, D], the result
    [B, 1, H, D] as `reference_attention` gives it). Scores carry gamma_D of |q|.|k_t| times the
    scale; a score error e moves each probability by at most 2e of itself (softmax), so the
    output by 2e * sum_t p_t |v_t|; the weighted sum adds gamma_T of sum_t p_t |v_t|; exp and
    the division add a few u more (8 u, generously). All twice: one bound for each order."""
    u = UNIT_ROUNDOFF[q.dtype]
    groups = q.shape[1] // k.shape[1]
    kd, vd = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = scale if scale is not None else q.shape[-1] ** -0.5
    logits = q.double() @ kd.transpose(-1, -2) * s  # [B, H, 1, T]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.double()
    p = logits.softmax(-1)
    weighted = p @ vd.abs()  # sum_t p_t |v_t|, [B, H, 1, D]
    d, t = q.shape[-1], k.shape[-2]
    score_err = d * u * (q.double().abs() @ kd.abs().transpose(-1, -2) * abs(s)).amax(-1, keepdim=True)
    bound = 2.0 * (2.0 * score_err + (t + 8) * u) * weighted
    return bound.transpose(1, 2)
