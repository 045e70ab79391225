"""What a GQA decode step's attention must equal: K/V copied up to all query heads
(repeat_kv), then SDPA. Shared by the decode-attention tests."""

from __future__ import annotations

import torch


def reference_attention(q, k, v, mask, scale):
    """q [B, H, 1, D], k/v [B, G, T, D], an SDPA mask or None -> [B, 1, H, Dv]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)
