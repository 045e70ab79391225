"""The grouped-QKV row layout of a fused projection (GPT-NeoX's `query_key_value`).

The output rows of the fused projection are viewed as `(G, H/G + 2, D)`: per K/V group
its H/G query heads, then its key head, then its value head. With G = H this is the stock
per-head `(H, 3, D)` layout. Conversion reads and writes heads through it
(`convert/layout.py`), and the fused CPU decode step re-stacks the rows as all queries,
all keys, all values (`runtime/families.py`).
"""

from __future__ import annotations

from typing import Any


def split_grouped_qkv(t: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Any, Any, Any]:
    """Rows `(G, H/G + 2, D, ...)` of `t` (dim 0) -> q `[H*D, ...]`, k `[G*D, ...]`, v `[G*D, ...]`."""
    r, rest = num_heads // num_kv_heads, t.shape[1:]
    g = t.reshape(num_kv_heads, r + 2, head_dim, *rest)
    return (g[:, :r].reshape(num_heads * head_dim, *rest), g[:, r].reshape(num_kv_heads * head_dim, *rest),
            g[:, r + 1].reshape(num_kv_heads * head_dim, *rest))


def join_grouped_qkv(q: Any, k: Any, v: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> Any:
    """The inverse of `split_grouped_qkv`: q, k, v rows -> the fused `(G, H/G + 2, D, ...)` rows."""
    import torch

    r, rest = num_heads // num_kv_heads, q.shape[1:]
    parts = [q.reshape(num_kv_heads, r, head_dim, *rest), k.reshape(num_kv_heads, 1, head_dim, *rest),
             v.reshape(num_kv_heads, 1, head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape((num_heads + 2 * num_kv_heads) * head_dim, *rest)
