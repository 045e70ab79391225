"""CodeGen: one fused qkv_proj whose rows are 4 blocks (the shards of the model-parallel run it
was trained with) of [q | v | k], rotate-every-two rotary on the first `rotary_dim` dims,
GQA through gqakit_modeling_codegen.py. The checks of test_family_gptj.py run here on
CodeGen's pico model (8 heads: 2 per block), with its tensors read by hand from
transformers' CodeGenAttention.forward (stock) and from the GQA layout documented in
gqakit_modeling_codegen.py (gcd(4, G) blocks of [H/n q | G/n v | G/n k])."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import pytest
import torch

from gqakit.core import arch
from gqakit.core.errors import GqakitError
from test_family_gptj import (Family, check_align_on_rotated_heads, check_cache_holds_g_heads,
                              check_carries_its_modeling_file, check_every_verb, check_generate_at_g_equal_h,
                              check_mean_is_the_mean)

H, D = 8, 4


def _blocks(model: Any, layer: int) -> tuple[Any, int, int]:
    """The layer's qkv_proj weight viewed as (blocks, rows of one block, in), and the head
    counts of one block (query, KV)."""
    w = model.transformer.h[layer].attn.qkv_proj.weight
    g = getattr(model.config, "num_key_value_heads", None) or H
    n = math.gcd(4, g)
    return w.view(n, -1, w.shape[1]), H // n, g // n


def codegen_qkv(model: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, hq, hkv = _blocks(model, layer)
    q, v, k = x.split([hq * D, hkv * D, hkv * D], dim=1)  # CodeGen's order within a block: q, v, k
    return tuple(t.reshape(-1, x.shape[2]) for t in (q, k, v))  # type: ignore[return-value]


def codegen_edit(model: Any, fn: Callable[..., None]) -> None:
    for i, block in enumerate(model.transformer.h):
        x, hq, hkv = _blocks(model, i)
        q, k, v = (t.clone() for t in codegen_qkv(model, i))
        fn(q, k, v, block.attn.out_proj.weight, i)
        n = x.shape[0]
        x.copy_(torch.cat([q.view(n, -1, x.shape[2]), v.view(n, -1, x.shape[2]), k.view(n, -1, x.shape[2])], dim=1))


CODEGEN = Family("codegen", H=H, D=D, ROT=2, qkv=codegen_qkv, edit=codegen_edit)


def test_generate_at_g_equal_h_is_the_original(tiny_model, tmp_path):
    check_generate_at_g_equal_h(CODEGEN, tiny_model("codegen"), tmp_path / "out")


def test_cache_holds_g_heads(tiny_model, tmp_path):
    check_cache_holds_g_heads(CODEGEN, tiny_model("codegen"), tmp_path)


def test_carries_its_modeling_file(tiny_model, tmp_path):
    check_carries_its_modeling_file(CODEGEN, tiny_model("codegen"), tmp_path / "out")


def test_mean_pools_each_group(tiny_model, tmp_path):
    """G = 2: the written qkv_proj has gcd(4, 2) = 2 blocks, read here by hand."""
    check_mean_is_the_mean(CODEGEN, tiny_model("codegen"), tmp_path / "out")


def test_align_undoes_rotations_of_interleaved_pairs(tiny_model, tmp_path, one_thread):
    """K and V are rotated differently (K by RoPE-commuting maps, V by any orthogonal one), so a
    layout that swapped K and V in the blocks would fail this, though it would copy G = H
    exactly."""
    check_align_on_rotated_heads(CODEGEN, tiny_model("codegen"), tmp_path)


def test_grouped_layout_keeps_four_blocks_where_g_allows(tiny_model, tmp_path):
    """G = 4 keeps 4 blocks of [2 q | 1 v | 1 k]: mean pooling of neighbouring pairs, read back by hand."""
    from gqakit.convert import convert_checkpoint
    from test_family_gptj import load

    src = tiny_model("codegen")
    got = load(convert_checkpoint(src, tmp_path / "g4", 4, "mean", progress=False))
    ref = load(src)
    for layer in range(2):
        q0, k0, v0 = codegen_qkv(ref, layer)
        w = got.transformer.h[layer].attn.qkv_proj.weight.view(4, 4 * D, -1)  # 4 blocks of (2 + 1 + 1) heads
        assert torch.equal(w[:, :2 * D].reshape(-1, w.shape[2]), q0)
        for orig, rows in ((v0, w[:, 2 * D:3 * D]), (k0, w[:, 3 * D:])):
            torch.testing.assert_close(rows.reshape(-1, w.shape[2]), orig.view(4, 2, D, -1).mean(1).reshape(4 * D, -1),
                                       rtol=0, atol=1e-6)  # a two-term float32 average


def test_heads_that_do_not_fill_the_blocks_are_refused(tiny_model):
    cfg = json.loads((tiny_model("codegen") / "config.json").read_text())
    with pytest.raises(GqakitError, match="codegen with 6 heads is not supported: its fused qkv_proj holds 4 blocks"):
        arch.shape_of(arch.lookup(cfg), {**cfg, "n_head": 6, "n_embd": 48})


def test_every_verb(tiny_model, tmp_path, capsys, one_thread):
    check_every_verb(CODEGEN, tiny_model("codegen"), tmp_path, capsys)


def test_table_checks_the_blocks_layout():
    entry = arch.registry()["codegen"].model_dump()
    for change, match in (({"blocks": None}, "blocks and order are given with layout fused_blocks"),
                          ({"order": ["q", "q", "k"]}, "an order of q, k and v, each once"),
                          ({"blocks": 0}, "blocks >= 1"),
                          ({"layout": "fused_concat"}, "only with it")):
        with pytest.raises(ValueError, match=match):
            arch.ArchSpec.model_validate({**entry, "attention": {**entry["attention"], **change}})
