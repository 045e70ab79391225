"""The decode fast path: grouped matmul attention, packed weights, cache rewind."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gqakit.core.loading import load_causal_lm
from gqakit.runtime import kernels as cpu_kernels
from gqakit.runtime.attention import set_decode_kernel
from gqakit.runtime.grouped import decode_attention
from gqakit.runtime.packed import can_pack, packed_linears
from gqakit.eval.speed import DecodeBench
from reference_attention import reference_attention
from tolerance import assert_within, attention_bound, rounding_tolerance

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_decode_attention_equals_repeated_kv(kv_heads, mask_kind):
    torch.manual_seed(0)
    b, h, t, d = 3, 8, 11, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, kv_heads, t, d), torch.randn(b, kv_heads, t, d)
    mask = None
    if mask_kind != "none":
        keep = torch.rand(b, 1, 1, t) > 0.3
        keep[..., 0] = True
        mask = keep if mask_kind == "bool" else torch.zeros(b, 1, 1, t).masked_fill(~keep, float("-inf"))
    got = decode_attention(q, k, v, mask, 0.3)
    assert got.shape == (b, 1, h, d)
    assert_within(got, reference_attention(q, k, v, mask, 0.3), attention_bound(q, k, v, mask, 0.3))
    if mask_kind == "bool":  # the converted mask is reused for the same mask object, and not for another one
        torch.testing.assert_close(decode_attention(q, k, v, mask, 0.3), got)
        other = torch.ones_like(mask)
        assert_within(decode_attention(q, k, v, other, 0.3), reference_attention(q, k, v, other, 0.3),
                      attention_bound(q, k, v, other, 0.3))


def test_decode_attention_bf16_close_to_fp32():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 8, 1, 32), torch.randn(2, 2, 40, 32), torch.randn(2, 2, 40, 32)
    ref = reference_attention(q, k, v, None, None)
    got = decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, None).float()
    # bfloat16 inputs: each input's own rounding (u = 2^-8) moves a score by up to 2u of its
    # terms' magnitudes, on top of the sums' rounding; the bound for bfloat16 sums covers both
    assert_within(got, ref, attention_bound(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, None).float())


@pytest.mark.skipif(not can_pack("cpu", torch.float32), reason="torch built without oneDNN")
def test_packed_linears_equal_plain_and_are_undone(tiny_model):
    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    ids = torch.randint(0, model.config.vocab_size, (4, 1))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
        lin = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        with packed_linears(model, 4) as extra:
            assert extra > 0 and "forward" in lin.__dict__  # the layers really run the packed copies
            got = model(input_ids=ids).logits
        assert "forward" not in lin.__dict__
        # oneDNN's packed GEMMs sum in their own order: rounding over the model's whole path
        c = model.config
        path = c.num_hidden_layers * (4 * c.hidden_size + 2 * c.intermediate_size + ids.shape[1]) + c.hidden_size
        tol = rounding_tolerance(torch.float32, path, float(ref.abs().max()))
        torch.testing.assert_close(got, ref, rtol=0, atol=tol)
        torch.testing.assert_close(model(input_ids=ids).logits, ref)


def test_rewound_cache_decodes_like_a_fresh_prefill(tiny_model):
    """prefill once: decoding again after a rewind gives the tokens of a fresh prefill."""
    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    prompt = torch.randint(0, bench.vocab, (2, 12))
    with torch.inference_mode():
        cache = bench.new_cache(2, 12 + 6)
        _, tok = bench.prefill(cache, prompt)
        first: list = []
        bench.decode(cache, tok, 12, 6, tokens=first)
        bench.rewind(cache, 12)
        again: list = []
        bench.decode(cache, tok, 12, 6, tokens=again)
        cache.reset()
        _, tok2 = bench.prefill(cache, prompt)
        fresh: list = []
        bench.decode(cache, tok2, 12, 6, tokens=fresh)
    assert torch.equal(torch.cat(first, 1), torch.cat(fresh, 1)) and torch.equal(torch.cat(again, 1), torch.cat(fresh, 1))


@pytest.mark.parametrize("eager", [False, True])
def test_point_records_the_path_it_took(tiny_model, eager):
    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32, pack_weights=not eager,
                        decode_kernel="sdpa" if eager else "matmul")
    roof = {"copy_bandwidth": 1e10, "matmul_flops": 1e11, "ridge_flops_per_byte": 10.0}
    pt = bench.run_point(2, 8, 4, 3, 1, roof, prefill_once=True)
    assert pt.status == "ok" and pt.prefill_samples == 1 and len(pt.to_json()) > 10
    assert pt.decode_path["prefill"] == "once, decode repetitions rewind the cache"
    packs = can_pack("cpu", torch.float32) and not eager
    kernels = packs and cpu_kernels.load() is not None
    fast = "cpu" if kernels else "matmul"
    assert pt.decode_path["attention_kernel"] == ("sdpa" if eager else fast)
    assert (pt.packed_weight_bytes > 0) == packs
    assert pt.decode_path["weights"] == ("as loaded" if not packs else "packed once (gqakit panels)" if kernels
                                         else "packed once (oneDNN)")
    assert ("CPU kernels" in pt.decode_path["steps"]) == kernels
    assert pt.roofline_ms["bytes"] == pytest.approx(1e3 * pt.bytes_per_step["total"] / 1e10)
    assert bench.probe()["decode_kernel"] == ("sdpa" if eager else fast)
    pt1 = bench.run_point(1, 8, 4, 2, 0, roof)  # batch 1: the BLAS's matrix-vector path unless the panel kernel
    assert (pt1.packed_weight_bytes > 0) == kernels and pt1.prefill_samples == 2


def test_single_steps_alternate_between_two_models(tiny_model):
    """bench_decode_pair's stepping: two open points, steps one by one, every step a sample."""
    benches = [DecodeBench(load_causal_lm(tiny_model("llama", num_key_value_heads=kv)), device="cpu",
                           dtype=torch.float32) for kv in (8, 2)]
    roof = {"copy_bandwidth": 1e10, "matmul_flops": 1e11, "ridge_flops_per_byte": 10.0}
    states = [b.open_point(2, 8, 3, 1, prefill_once=True) for b in benches]
    for _ in range(2):
        for b, st in zip(benches, states):
            b.begin_rep(st)
        for _ in range(3):
            for b, st in zip(benches, states):
                assert b.timed_step(st) > 0
    pts = [b.close_point(st, roof) for b, st in zip(benches, states)]  # closed in the order opened
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()  # nothing left switched on
    for pt in pts:
        assert pt.status == "ok" and pt.reps == 2 and pt.decode_samples == 6
        assert pt.decode_sample == "one step" and pt.prefill_samples == 1
        assert pt.decode_path["prefill"] == "once, decode repetitions rewind the cache"
    assert pts[0].bytes_per_step["total"] > pts[1].bytes_per_step["total"]


@pytest.mark.slow
def test_compiled_cpu_step_decodes_the_eager_tokens(tiny_model):
    """--compile on the CPU (inductor, weights frozen): same greedy tokens as the eager step,
    over two grid points and two models (more graphs than dynamo's default recompile limit of
    8 per code object: prefill + decode per point and model), compile time reported apart."""
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on the CPU needs a C++ compiler")
    roof = {"copy_bandwidth": 1e10, "matmul_flops": 1e11, "ridge_flops_per_byte": 10.0}
    for kv in (4, 2):
        model = load_causal_lm(tiny_model("llama", num_key_value_heads=kv))
        eager = DecodeBench(model, device="cpu", dtype=torch.float32)
        comp = DecodeBench(model, device="cpu", dtype=torch.float32, compile=True)
        kernels = cpu_kernels.load() is not None  # then custom ops in the compiled step, weights in panels
        assert comp.decode_mode == ("torch.compile, gqakit CPU kernels as custom ops (panel GEMM, fused decode "
                                    "attention)" if kernels else "torch.compile, weights frozen")
        assert comp.pack_weights == kernels
        for b, p in ((2, 8), (3, 12)):
            prompt = torch.randint(0, eager.vocab, (b, p))
            toks = []
            for bench in (eager, comp):
                set_decode_kernel(bench.model, bench.decode_kernel)
                packed = packed_linears(model, b, kernels=bench.kernels) if bench.kernels else contextlib.nullcontext()
                with torch.inference_mode(), packed:
                    cache = bench.new_cache(b, p + 5)
                    _, tok = bench.prefill(cache, prompt)
                    out: list = []
                    bench.decode(cache, tok, p, 4, tokens=out)
                toks.append(torch.cat(out, 1))
            assert torch.equal(toks[0], toks[1])
            pt = comp.run_point(b, p, 3, 2, 1, roof, prefill_once=True)
            assert pt.status == "ok" and pt.compile_s is not None and pt.compile_s >= 0
