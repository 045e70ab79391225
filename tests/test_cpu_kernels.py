"""gqakit's compiled CPU decode kernels equal what they replace (skipped where they can't be built)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from gqakit.core.loading import load_causal_lm
from gqakit.runtime import kernels as cpu_kernels
from gqakit.runtime.attention import set_decode_kernel
from gqakit.runtime.grouped import decode_attention, fused_applies
from gqakit.runtime.packed import packed_linears
from gqakit.runtime.layers import build_fused_decode
from gqakit.eval.speed import DecodeBench
from reference_attention import reference_attention
from tiny_models import FAMILIES
from tolerance import assert_within, attention_bound, linear_bound

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.numerics]


def cpu_flags() -> set[str]:
    """This processor's feature flags, as the compiler's -march=native sees them."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def has_toolchain() -> bool:
    from torch.utils.cpp_extension import is_ninja_available

    return shutil.which(os.environ.get("CXX", "c++")) is not None and is_ninja_available()


@pytest.fixture(scope="module")
def kernels():
    mod = cpu_kernels.load()
    if mod is None:
        why = f"CPU kernels not built here: {cpu_kernels.why_unavailable()}"
        if has_toolchain() and not os.environ.get("GQAKIT_NO_CPU_KERNELS"):
            pytest.fail(why)  # a compiler and ninja are here: the source itself failed to build
        pytest.skip(why)
    return mod


def test_a_failed_build_is_not_tried_again_with_the_same_toolchain(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as ext

    calls = []

    def failing(*args, **kwargs):
        calls.append(kwargs["build_directory"])
        raise RuntimeError("Error building extension 'gqakit_cpu_kernels': c++ said no\nmore lines")

    monkeypatch.setenv("GQAKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("GQAKIT_NO_CPU_KERNELS", raising=False)
    monkeypatch.setattr(ext, "load", failing)
    with cpu_kernels.loaded_afresh():
        assert cpu_kernels.load() is None and len(calls) == 1
        assert "c++ said no" in cpu_kernels.why_unavailable()
    with cpu_kernels.loaded_afresh():  # a later process: the recorded failure, no second build
        assert cpu_kernels.load() is None and len(calls) == 1
        why = cpu_kernels.why_unavailable()
        assert "c++ said no" in why and "earlier build" in why and calls[0] in why
    monkeypatch.setattr(cpu_kernels, "toolchain", lambda: "another compiler")
    with cpu_kernels.loaded_afresh():  # another toolchain builds again
        assert cpu_kernels.load() is None and len(calls) == 2


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file() or os.uname().machine != "x86_64", reason="x86-64 Linux")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v4"])
def test_the_source_compiles_with_and_without_avx512(march):
    """The native build compiles one of the two paths; both must compile (syntax only)."""
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    if not has_toolchain():
        pytest.skip("no C++ compiler or ninja")
    inc = [a for p in [*include_paths(), sysconfig.get_paths()["include"]] for a in ("-isystem", p)]
    src = Path(cpu_kernels.__file__).with_name("cpu_kernels.cpp")
    r = subprocess.run([os.environ.get("CXX", "c++"), "-fsyntax-only", "-std=c++17", f"-march={march}", "-fopenmp",
                        "-Wno-psabi", "-DTORCH_EXTENSION_NAME=gqakit_cpu_kernels", "-DTORCH_API_INCLUDE_EXTENSION_H",
                        *inc, str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("n,k,rows", [(576, 576, 8), (100, 37, 1), (50, 64, 13), (49, 96, 3), (192, 576, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_linear(kernels, n, k, rows, bias):
    """Panels of 48 columns, N not a multiple of 48 (zero padding cut off), rows past 8 (two blocks)."""
    torch.manual_seed(n + k + rows)
    w, x = torch.randn(n, k), torch.randn(2, rows, k)
    b = torch.randn(n) if bias else None
    got = kernels.skinny_linear(x, kernels.pack_weight(w), n, b)
    assert got.shape == (2, rows, n)
    assert_within(got, torch.nn.functional.linear(x, w, b), linear_bound(x, w, b), "skinny_linear")


def test_skinny_linear_rejects_a_mismatched_input(kernels):
    packed = kernels.pack_weight(torch.randn(48, 32))
    with pytest.raises(RuntimeError, match="features"):
        kernels.skinny_linear(torch.randn(2, 31), packed, 48, None)
    with pytest.raises(RuntimeError, match="packed"):
        kernels.skinny_linear(torch.randn(2, 32), torch.randn(48, 32), 48, None)


@pytest.mark.parametrize("h,kv_heads", [(8, 8), (8, 2), (8, 1), (9, 3), (9, 1), (26, 2)])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
@pytest.mark.parametrize("t,d", [(11, 16), (700, 64), (300, 20), (130, 48)])
def test_fused_decode_attention_equals_repeated_kv(kernels, h, kv_heads, mask_kind, t, d):
    """Several cache chunks (256 positions each) merged by log-sum-exp, masked positions,
    head sizes that are and are not a multiple of the vector width (48: one 32-column block of
    the value sums and a narrower one), 1 to 13 query rows per
    K/V head (each scores path: per-row sums, one reduction tree, transposed keys; more
    rows than one pass of the transposed scores holds)."""
    torch.manual_seed(t + kv_heads + h)
    b = 3
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, kv_heads, t, d), torch.randn(b, kv_heads, t, d)
    mask = None
    if mask_kind != "none":
        keep = torch.rand(b, 1, 1, t) > 0.3
        keep[..., 0] = True
        keep[0, ..., t // 2:] = False  # a static cache's unfilled tail: whole chunks skipped
        mask = keep if mask_kind == "bool" else torch.zeros(b, 1, 1, t).masked_fill(~keep, float("-inf"))
    assert fused_applies(q, k, v, mask)
    got = decode_attention(q, k, v, mask, 0.3, fused=True)
    assert got.shape == (b, 1, h, d)
    assert_within(got, reference_attention(q, k, v, mask, 0.3), attention_bound(q, k, v, mask, 0.3))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("t", [11, 40, 300, 700])
def test_one_sequence_one_kv_head_splits_the_cache_and_agrees(kernels, threads, t):
    """Batch 1 with one K/V head: chunks shorter than 256 positions so that every thread gets
    work (two tasks per thread), with the same merged result."""
    torch.manual_seed(t + threads)
    q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 1, t, 64), torch.randn(1, 1, t, 64)
    mask = torch.zeros(1, 1, 1, t)
    mask[..., t - t // 5:] = float("-inf")  # an unfilled tail
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_attention(q, k, v, mask, 0.125, fused=True)
    finally:
        torch.set_num_threads(before)
    assert_within(got, reference_attention(q, k, v, mask, 0.125), attention_bound(q, k, v, mask, 0.125))


@pytest.mark.parametrize("h,kv_heads,t,d", [(12, 1, 37, 64), (12, 2, 300, 16), (6, 1, 16, 32), (8, 2, 40, 64),
                                             (12, 1, 40, 20)])
def test_key_blocks_are_the_keys_transposed_in_blocks_of_16(kernels, h, kv_heads, t, d):
    """`key_blocks`: [B, G, ceil(T/16), D, 16], position blocks zero-padded past T; made only
    where the attention reads keys that way (6 or more query heads per K/V head, a head size a
    multiple of 16, AVX-512), else empty."""
    k = torch.randn(2, kv_heads, t, d)
    got = kernels.key_blocks(k, h)
    # the kernels are built with -march=native: AVX-512 is this processor's, whatever ATen's
    # dispatch (ATEN_CPU_CAPABILITY) picks for torch's own ops
    takes_path = h // kv_heads >= 6 and d % 16 == 0 and "avx512f" in cpu_flags()
    if not takes_path:
        assert got.numel() == 0
        return
    nb = -(-t // 16)
    padded = torch.nn.functional.pad(k, (0, 0, 0, nb * 16 - t))
    assert torch.equal(got, padded.reshape(2, kv_heads, nb, 16, d).transpose(-1, -2))


def test_fused_attention_falls_back_where_it_does_not_apply(kernels):
    q, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 9, 16)
    k = torch.randn(2, 9, 2, 16).transpose(1, 2)  # not contiguous: the matmul path takes it
    assert not fused_applies(q, k, v, None) and not fused_applies(q.bfloat16(), v.bfloat16(), v.bfloat16(), None)
    torch.testing.assert_close(decode_attention(q, k, v, None, None, fused=True), reference_attention(q, k, v, None, None),
                               rtol=1e-5, atol=1e-5)


def test_kernel_step_decodes_the_plain_tokens(kernels, tiny_model):
    """The whole fast step (panel GEMMs and fused attention) against the plain transformers
    step (SDPA, loaded weights): same greedy tokens, batch 1 and 3, 8 steps."""
    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    fast = DecodeBench(model, device="cpu", dtype=torch.float32)
    plain = DecodeBench(model, device="cpu", dtype=torch.float32, pack_weights=False, decode_kernel="sdpa")
    assert fast.kernels is not None and plain.kernels is None
    for batch in (1, 3):
        prompt = torch.randint(0, fast.vocab, (batch, 10))
        tokens = []
        for bench in (fast, plain):
            set_decode_kernel(bench.model, bench.decode_kernel)
            packed = packed_linears(model, batch, kernels=bench.kernels) if bench.kernels else contextlib.nullcontext()
            with torch.inference_mode(), packed:
                cache = bench.new_cache(batch, 10 + 8)
                _, tok = bench.prefill(cache, prompt)
                out: list = []
                bench.decode(cache, tok, 10, 8, tokens=out)
            tokens.append(torch.cat(out, 1))
        assert torch.equal(tokens[0], tokens[1])


def test_without_the_kernels_the_fallback_runs_and_says_why(tiny_model, monkeypatch):
    """No compiler, no ninja, or GQAKIT_NO_CPU_KERNELS: oneDNN weights and the matmul attention,
    and the attention probe records why (what a machine without a C++ toolchain gets)."""
    monkeypatch.setenv("GQAKIT_NO_CPU_KERNELS", "1")
    with cpu_kernels.loaded_afresh():
        model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
        bench = DecodeBench(model, device="cpu", dtype=torch.float32)
        assert bench.kernels is None and bench.decode_kernel == "matmul" and bench.decode_mode == "eager"
        assert "GQAKIT_NO_CPU_KERNELS" in bench.probe()["kernel_note"]
        roof = {"copy_bandwidth": 1e10, "matmul_flops": 1e11, "ridge_flops_per_byte": 10.0}
        pt = bench.run_point(2, 8, 3, 1, 0, roof)
    assert pt.status == "ok" and pt.decode_path["attention_kernel"] == "matmul"
    assert pt.decode_path["weights"] in ("packed once (oneDNN)", "as loaded")


# Llama layout (Qwen2: q/k/v biases; Qwen3: q/k norms; OLMo: LayerNorm without parameters; Gemma:
# 1 + w norms, scaled embeddings, tanh-GELU gate; StableLM: LayerNorms, partial rotary), Phi, GPT-NeoX, GPT-2, OPT
FUSED_FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "olmo", "gpt_neox", "gpt2", "opt", "gemma", "stablelm", "phi",
                  "phi3"}


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_decode_layers_decode_the_plain_tokens_or_say_why_not(kernels, tiny_model, family):
    """One compiled call per layer (decode_layers.FusedDecode) where the layout is Llama's:
    the same greedy tokens as the model's own step (SDPA, loaded weights), batch 1 and 3,
    8 steps, and the same cache fill; every other family gets a reason and the per-op path."""
    kw = {"num_key_value_heads": 2} if family in FUSED_FAMILIES - {"gpt_neox", "gpt2", "opt"} else {}  # stock MHA
    model = load_causal_lm(tiny_model(family, **kw))
    torch.manual_seed(0)
    with torch.no_grad():  # norm weights away from their initial ones, biases from their zeros:
        for name, p in model.named_parameters():  # a step that skipped one would differ
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    step, why = build_fused_decode(model, kernels, bench.new_cache, bench.vocab, bench.cache_kw)
    if family not in FUSED_FAMILIES:
        assert step is None and why
        return
    assert step is not None, why
    set_decode_kernel(model, "sdpa")  # the reference: transformers' step with SDPA, loaded weights
    for batch in (1, 3):
        prompt = torch.randint(0, bench.vocab, (batch, 10))
        runs = []
        for fn in (step, None):
            with torch.inference_mode():
                cache = bench.new_cache(batch, 10 + 8)
                _, tok = bench.prefill(cache, prompt)
                out = []
                for i in range(8):
                    out.append(tok)
                    pos = torch.full((1, 1), 10 + i)
                    f = fn or (lambda **a: model(**a, use_cache=True))
                    tok = f(input_ids=tok, **{bench.cache_kw: cache}, position_ids=pos).logits[:, -1].argmax(-1, keepdim=True)
            runs.append((torch.cat(out, 1), cache))
        assert torch.equal(runs[0][0], runs[1][0])
        for a, b in zip(runs[0][1].layers, runs[1][1].layers):
            assert int(a.cumulative_length) == int(b.cumulative_length) == 18
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["sequential, full rotary", "converted to 2 KV heads", "gpt2 converted",
                                     "opt converted", "stablelm parallel"])
def test_gpt_neox_and_gpt2_variants_take_the_fused_step(kernels, tiny_model, tmp_path, variant):
    """GPT-NeoX beyond stock Pythia's parallel residual and quarter rotary: sequential residuals
    with full rotary, and gqakit's grouped NeoX (query_key_value rows per group: queries, key,
    value); gqakit's grouped GPT-2 (c_attn: queries, then G keys, then G values) and OPT; and
    StableLM's parallel residual; each checked against the model's own step for several prompts."""
    from gqakit.convert import convert_checkpoint
    from gqakit.runtime.layers import check

    if variant.startswith("sequential"):
        path = tiny_model("gpt_neox", use_parallel_residual=False, rotary_pct=1.0)
    elif variant.startswith("stablelm"):  # one LayerNorm feeding attention and MLP side by side
        path = tiny_model("stablelm", use_parallel_residual=True, num_key_value_heads=2)
    elif variant.startswith(("gpt2", "opt")):
        path = convert_checkpoint(tiny_model(variant.split()[0]), tmp_path / "g2", 2, progress=False)
    else:
        path = convert_checkpoint(tiny_model("gpt_neox"), tmp_path / "g2", 2, progress=False)
    model = load_causal_lm(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name or ".ln_" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # q/k/v, dense and MLP biases: not the zeros they start as
                p.normal_(0, 0.05)
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    step, why = build_fused_decode(model, kernels, bench.new_cache, bench.vocab, bench.cache_kw)
    assert step is not None, why
    assert step.parallel is variant.startswith(("converted", "stablelm"))  # NeoX's stock config: parallel
    assert variant.startswith("sequential") or model.config.num_key_value_heads == 2
    assert all(check(model, step, bench.new_cache, bench.vocab, bench.cache_kw, seed=s) is None for s in range(4))


def test_opt_350m_layout_keeps_the_per_op_path(kernels, tiny_model):
    """OPT-350M normalises after each block (do_layer_norm_before=False): not fused, and said why."""
    model = load_causal_lm(tiny_model("opt", do_layer_norm_before=False))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    step, why = build_fused_decode(model, kernels, bench.new_cache, bench.vocab, bench.cache_kw)
    assert step is None and "opt-350m" in why


# family, config overrides, how to break its fused step (self: the FusedDecode, m: the model)
BROKEN = {
    "Qwen3 without its q norm": ("qwen3", {"num_key_value_heads": 2},
                                 lambda self, m: [setattr(e, "qnorm", torch.ones_like(e.qnorm)) for e in self.layers]),
    "OLMo without its clip_qkv": ("olmo", {"num_key_value_heads": 2, "clip_qkv": 0.05},
                                  lambda self, m: setattr(self, "clip_qkv", 0.0)),
    "Pythia with sequential residuals": ("gpt_neox", {}, lambda self, m: setattr(self, "parallel", False)),
    "GPT-2 without learned positions": ("gpt2", {},
                                        lambda self, m: setattr(self, "embed", lambda ids, pos: m.transformer.wte(ids))),
    "Gemma with w for its 1 + w norms": ("gemma", {"num_key_value_heads": 2}, lambda self, m: [
        setattr(e, "ln1", e.ln1 - 1) for e in self.layers]),
    "Phi with sequential residuals": ("phi", {"num_key_value_heads": 2}, lambda self, m: setattr(self, "parallel", False)),
    "OPT without its position offset": ("opt", {}, lambda self, m: setattr(
        self, "embed", lambda ids, pos: m.model.decoder.embed_tokens(ids) + m.model.decoder.embed_positions.weight[pos])),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_fused_step_missing_a_family_feature_is_not_used(kernels, tiny_model, monkeypatch, case):
    """Each family's own part of the fused layer matters: the step is used as built, and refused
    with that part left out (Qwen3's per-head q norm, OLMo's clamp of q/k/v, Pythia's parallel
    residual, GPT-2's learned positions, OPT's offset of 2 into its position table)."""
    from gqakit.runtime import layers as decode_layers

    family, overrides, breaks = BROKEN[case]
    model = load_causal_lm(tiny_model(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    step, why = build_fused_decode(model, kernels, bench.new_cache, bench.vocab, bench.cache_kw)
    assert step is not None, why
    if family == "olmo":
        assert step.clip_qkv == pytest.approx(0.05)
    real = decode_layers.FusedDecode.__init__

    def broken(self, m, k, **kw):
        real(self, m, k, **kw)
        breaks(self, m)

    monkeypatch.setattr(decode_layers.FusedDecode, "__init__", broken)
    step, why = build_fused_decode(model, kernels, bench.new_cache, bench.vocab, bench.cache_kw)
    assert step is None and why


def _wrapped_step(monkeypatch, after):
    """FusedDecode with `after(out, cache, slot)` run after each step (to perturb or break it)."""
    from gqakit.runtime import layers as decode_layers

    real = decode_layers.FusedDecode.__call__

    def call(self, input_ids, cache=None, past_key_values=None, position_ids=None, **kw):
        cache = cache if cache is not None else past_key_values
        slot = int(cache.layers[0].cumulative_length)
        out = real(self, input_ids, cache=cache, position_ids=position_ids)
        after(out, cache, slot)
        return out

    monkeypatch.setattr(decode_layers.FusedDecode, "__call__", call)


def test_the_check_allows_fp32_rounding(kernels, tiny_model, monkeypatch):
    """fp32 steps with other summation orders differ by ~1e-5 relative, more in deep layers (SmolLM2's
    3->1 conversion: up to 5e-5, which an element-wise 1e-4 bound refused in one run of three):
    such a step is used. (SmolLM2 itself: test_the_check_passes_smollm2_at_one_kv_head.)"""
    gen = torch.Generator().manual_seed(1)

    def jitter(out, cache, slot):
        for t in [out.logits] + [t[:, :, slot] for layer in cache.layers for t in (layer.keys, layer.values)]:
            t.add_(5e-5 * t.pow(2).mean().sqrt() * torch.randn(t.shape, generator=gen))  # 5e-5 relative, not per element

    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    _wrapped_step(monkeypatch, jitter)
    step, why = build_fused_decode(model, kernels, bench.new_cache, bench.vocab, bench.cache_kw)
    assert why is None and step is not None


def test_a_fused_step_writing_another_slot_is_not_used(kernels, tiny_model, monkeypatch):
    """The new token's keys and values land one slot late: refused, whatever the logits."""

    def shift(out, cache, slot):
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                t[:, :, slot + 1] = t[:, :, slot]
                t[:, :, slot] = 0

    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    _wrapped_step(monkeypatch, shift)
    step, why = build_fused_decode(model, kernels, bench.new_cache, bench.vocab, bench.cache_kw)
    assert step is None and "another cache slot" in why and "(layer 1," in why  # counted from 1


@pytest.mark.slow
def test_the_check_passes_smollm2_at_one_kv_head(kernels, tmp_path):
    """The real case: SmolLM2-135M (30 layers) mean-pooled to 1 KV head, 30 prompts. An element-wise
    check would refuse about one prompt in five (`bench/fused_check_errors.py`), and the speed
    benchmark would then run the slower per-op path for that model only."""
    from pathlib import Path

    from gqakit.convert import convert_checkpoint
    from gqakit.runtime.layers import FusedDecode, check

    src = Path("~/.cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
    if not src.is_file():
        pytest.skip(f"{src} not found (run `gqakit demo` once)")
    model = load_causal_lm(convert_checkpoint(src, tmp_path / "g1", 1, progress=False))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    step = FusedDecode(model, kernels)
    assert [check(model, step, bench.new_cache, bench.vocab, bench.cache_kw, seed=s) for s in range(30)] == [None] * 30


def test_speed_bench_records_which_layer_path_ran(kernels, tiny_model):
    roof = {"copy_bandwidth": 1e10, "matmul_flops": 1e11, "ridge_flops_per_byte": 10.0}
    fused = DecodeBench(load_causal_lm(tiny_model("llama", num_key_value_heads=2)), device="cpu", dtype=torch.float32)
    pt = fused.run_point(2, 8, 3, 1, 0, roof)
    assert pt.status == "ok" and pt.decode_path["layers"] == "fused, one compiled call per layer"
    assert "fused decode layers" in pt.decode_mode
    if os.path.exists("/proc/self/smaps_rollup"):  # how much of the packed weights is on huge pages
        assert 0.0 <= pt.decode_path["packed_on_huge_pages"] <= 1.0
    other = DecodeBench(load_causal_lm(tiny_model("gemma2")), device="cpu", dtype=torch.float32)
    pt = other.run_point(2, 8, 3, 1, 0, roof)
    assert pt.status == "ok" and pt.decode_path["layers"].startswith("per-op") and "sliding" in pt.decode_path["layers"]
    off = DecodeBench(load_causal_lm(tiny_model("llama", num_key_value_heads=2)), device="cpu", dtype=torch.float32,
                      fuse_layers=False)
    assert off.run_point(2, 8, 3, 1, 0, roof).decode_path["layers"] == "per-op (transformers' modules)"


def test_a_fused_step_that_disagrees_is_not_used(kernels, tiny_model, monkeypatch):
    """The check before use: a fused step whose logits differ (here: a wrong norm epsilon) is refused."""
    from gqakit.runtime import layers as decode_layers

    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    real = decode_layers.FusedDecode.__init__

    def broken(self, m, k):
        real(self, m, k)
        for e in self.layers:
            e.eps1 = 10.0

    monkeypatch.setattr(decode_layers.FusedDecode, "__init__", broken)
    step, why = build_fused_decode(model, kernels, bench.new_cache, bench.vocab, bench.cache_kw)
    assert step is None and "other logits" in why
