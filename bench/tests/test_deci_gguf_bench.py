"""bench/bench_deci_gguf.py: which matmuls get llama.cpp's 8-bit activations (no llama.cpp needed)."""

from __future__ import annotations

import torch

from bench.bench_deci_gguf import quantised_inputs, rounding_hooks


def test_only_matmuls_of_quantised_weights_round_their_input():
    types = {"model.embed_tokens.weight": "Q4_1", "model.layers.0.self_attn.q_proj.weight": "Q4_1",
             "model.layers.0.self_attn.k_proj.weight": "F32", "model.layers.0.input_layernorm.weight": "F32",
             "model.layers.0.mlp.down_proj.weight": "Q8_0"}
    got = quantised_inputs(types, tied=True)
    # the tied LM head multiplies by the Q4_1 embedding; the embedding itself is a lookup
    assert got == {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"}
    assert "lm_head" not in quantised_inputs(types, tied=False)
    assert "lm_head" not in quantised_inputs({**types, "model.embed_tokens.weight": "F16"}, tied=True)


def test_the_hooks_round_only_the_named_linears():
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(64, 4, bias=False), "b": torch.nn.Linear(64, 4, bias=False)})
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64)
    plain = {n: m(x) for n, m in model.items()}
    handles = rounding_hooks(model, {"a"})
    try:
        assert not torch.equal(model["a"](x), plain["a"]) and torch.equal(model["b"](x), plain["b"])
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(model["a"](x), plain["a"])
