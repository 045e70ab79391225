"""Decode benchmark: static cache, real GQA attention path, KV bytes, OOM handling."""

from __future__ import annotations

import pytest
import torch

from gqakit.core.errors import GqakitError
from gqakit.core.loading import cache_kwarg, load_causal_lm
from gqakit.runtime.attention import gqa_sdpa_forward
from gqakit.eval.speed import DecodeBench, SpeedSettings, evaluate_speed, parse_ints, percentile


pytestmark = pytest.mark.usefixtures("one_thread")


SMALL = SpeedSettings(batches=(1, 2), prompt_lens=(16,), new_tokens=4, reps=2, warmup=1)


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_grid_reports_real_cache_bytes_and_gqa_path(tiny_model, kv_heads):
    model = load_causal_lm(tiny_model("llama", num_key_value_heads=kv_heads))
    res = evaluate_speed(model, SMALL, device="cpu", dtype=torch.float32, progress=False)
    att = res.attention
    assert att["implementation"] == "gqakit_sdpa" and att["kv_copied"] is False
    assert att["sdpa_kv_heads"] == kv_heads  # SDPA was handed the cache's own heads, not copies
    per_token = 2 * 2 * kv_heads * 4 * 4  # K+V, 2 layers, head_dim 4, fp32
    assert res.kv_bytes_per_token == per_token
    assert [(g.batch, g.prompt_len) for g in res.grid] == [(1, 16), (2, 16)]
    for g in res.grid:
        assert g.status == "ok"
        assert g.kv_cache_bytes == g.kv_cache_bytes_analytic == g.batch * (16 + 4) * per_token
        assert g.decode_ms_per_token["median"] > 0 and g.prefill_ms["median"] > 0
        assert g.decode_ms_per_token["p90"] >= g.decode_ms_per_token["median"]
        assert 0 < g.roofline_fraction < 1
    assert res.device_roof["copy_bandwidth_gbs"] > 0


def test_gqa_attention_matches_stock_sdpa(tiny_model):
    """The packed decode path computes the same logits as transformers' own attention."""
    from transformers import StaticCache

    folder = tiny_model("llama", num_key_value_heads=2)
    outs = []
    for impl in ("stock", "gqakit"):
        model = load_causal_lm(folder)
        if impl == "gqakit":
            DecodeBench(model, device="cpu", dtype=torch.float32)  # switches the attention function
        cache = StaticCache(config=model.config, max_cache_len=12)
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model(input_ids=x, **{cache_kwarg(model): cache}, position_ids=torch.arange(8)[None])
            nxt = torch.tensor([[5], [7]])
            outs.append(model(input_ids=nxt, **{cache_kwarg(model): cache}, position_ids=torch.tensor([[8]])).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_packed_decode_equals_repeated_kv():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 1, 4), torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4)
    mask = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    mask[:, :, :, 7:] = False
    out, _ = gqa_sdpa_forward(None, q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                            attn_mask=mask)
    torch.testing.assert_close(out, ref.transpose(1, 2))


def test_oom_point_is_reported_not_raised(tiny_model, monkeypatch):
    import gqakit.eval.speed.bench as speed_bench

    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    need_b2 = bench.predicted_bytes(2, 16, 4)
    # Pretend the host has room for batch 1 only: 80% of this is between the two needs.
    monkeypatch.setattr(speed_bench, "available_memory", lambda device: int(need_b2 / 0.8) - 1)
    res = evaluate_speed(model, SMALL, device="cpu", dtype=torch.float32, progress=False)
    assert [g.status for g in res.grid] == ["ok", "oom"]
    assert "predicted" in res.grid[1].reason
    assert bench.max_batch(16, 4, limit=64).max_batch == 1


def test_max_batch_search_bisects(tiny_model, monkeypatch):
    model = load_causal_lm(tiny_model("llama"))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    monkeypatch.setattr(bench, "fits", lambda b, p, n: b <= 37)
    assert bench.max_batch(16, 4, limit=1000).max_batch == 37
    assert bench.max_batch(16, 4, limit=20).to_json() == {"prompt_len": 16, "max_batch": 20, "at_limit": True, "limit": 20,
                                                "method": "predicted from available host memory"}


def test_bad_settings(tiny_model):
    model = load_causal_lm(tiny_model("llama"))
    with pytest.raises(GqakitError, match="exceeds the model's 128 positions"):
        evaluate_speed(model, SpeedSettings(batches=(1,), prompt_lens=(120,), new_tokens=16), device="cpu",
                       dtype=torch.float32, max_positions=128, progress=False)
    with pytest.raises(GqakitError, match="comma-separated"):
        parse_ints("1,x", "--batch")
    with pytest.raises(GqakitError, match="positive"):
        parse_ints("0", "--batch")
    assert parse_ints("1, 8,32", "--batch") == (1, 8, 32)
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)


def test_cuda_graphs_are_ignored_off_cuda(tiny_model):
    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32, cuda_graphs=True)
    assert not bench.cuda_graphs and bench.decode_mode.startswith("eager")  # ", gqakit CPU kernels" where built
    roof = {"copy_bandwidth": 1e10, "ridge_flops_per_byte": 10.0}
    assert bench.run_point(1, 8, 2, 1, 0, roof).decode_mode == bench.decode_mode


@pytest.mark.gpu
def test_cuda_graph_decode_replays_the_eager_steps(tiny_model):
    """A captured decode step gives the eager step's greedy tokens, and the point says it used graphs."""
    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2)).to("cuda")
    bench = DecodeBench(model, device="cuda", dtype=torch.float32, cuda_graphs=True)
    roof = {"copy_bandwidth": 1e12, "ridge_flops_per_byte": 100.0}
    for batch in (1, 3):
        point = bench.run_point(batch, 16, 8, 2, 1, roof)
        assert bench.graph_error is None and bench.graph_checked
        assert point.status == "ok" and point.decode_mode == "CUDA graph per step"
    with torch.inference_mode():
        cache = bench.new_cache(2, 24)
        graph = bench.capture_graph(cache, 2)
        prompt = torch.randint(0, bench.vocab, (2, 16), device="cuda")
        eager, graphed = [], []
        bench.generate(cache, prompt, 8, tokens=eager)
        cache.reset()
        bench.generate(cache, prompt, 8, graph=graph, tokens=graphed)
    assert torch.equal(torch.cat(eager, 1), torch.cat(graphed, 1))


@pytest.mark.gpu
def test_masked_cuda_prefill_matches_stock_sdpa():
    """The CUDA prefill path (K/V copied up to all heads) computes the same attention as the CPU one."""
    q, k, v = (torch.randn(2, 8, 6, 4, device="cuda"), torch.randn(2, 2, 10, 4, device="cuda"),
               torch.randn(2, 2, 10, 4, device="cuda"))
    mask = torch.ones(2, 1, 6, 10, dtype=torch.bool, device="cuda").tril(diagonal=4)
    out, _ = gqa_sdpa_forward(None, q, k, v, mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                            attn_mask=mask)
    torch.testing.assert_close(out, ref.transpose(1, 2))
    # Unmasked, causal over a longer (static-cache) key length: upper-left alignment, as on the CPU.
    out, _ = gqa_sdpa_forward(None, q, k, v, None, is_causal=True)
    ref, _ = gqa_sdpa_forward(None, q.cpu(), k.cpu(), v.cpu(), None, is_causal=True)
    torch.testing.assert_close(out.cpu(), ref)


def test_graph_replay_plumbing_matches_eager_steps(tiny_model, monkeypatch):
    """The CUDA-graph decode loop (static token/position buffers, replay, read the static logits),
    run on the CPU with a stand-in graph that replays the eager step: the same greedy tokens,
    and the self-check passes. A stand-in that ignores its token input fails the check: eager again."""
    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    roof = {"copy_bandwidth": 1e10, "ridge_flops_per_byte": 10.0}

    def bench_with_stand_in(stale: bool) -> DecodeBench:
        bench = DecodeBench(model, device="cpu", dtype=torch.float32)

        def capture(cache, batch):
            tok = torch.zeros((batch, 1), dtype=torch.long)
            pos = torch.zeros((1, 1), dtype=torch.long)
            logits = torch.zeros(batch, 1, bench.vocab)
            frozen = tok.clone()

            class Graph:
                def replay(self):
                    t = frozen if stale else tok  # stale: the token baked in at capture
                    logits.copy_(model(input_ids=t, **{cache_kwarg(model): cache}, position_ids=pos, use_cache=True,
                                       logits_to_keep=1).logits)
            cache.reset()
            return Graph(), tok, pos, logits

        bench.cuda_graphs, bench.capture_graph = True, capture
        return bench

    bench = bench_with_stand_in(stale=False)
    point = bench.run_point(2, 8, 6, 1, 1, roof)
    assert point.decode_mode == "CUDA graph per step" and bench.graph_checked and bench.graph_error is None

    bench = bench_with_stand_in(stale=True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # the fallback syncs the (absent) GPU
    point = bench.run_point(2, 8, 6, 1, 1, roof)
    assert point.status == "ok" and point.decode_mode.startswith("eager")
    assert "other greedy tokens" in bench.graph_error and not bench.cuda_graphs


@pytest.mark.parametrize("tied", [True, False])
def test_flops_count_the_lm_head_once(tiny_model, tied):
    """A step multiplies by every weight but the input embedding; a tied one is the LM head."""
    model = load_causal_lm(tiny_model("llama", tie_word_embeddings=tied))
    bench = DecodeBench(model, device="cpu", dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    body = params - emb - (0 if tied else head)  # the decoder blocks and norms
    assert bench.matmul_params == body + head
    assert bench.weight_bytes == 4 * (body + head)


def test_models_timed_together_alternate_and_say_so(tiny_model):
    """The demo's joint measurement: every model gets the whole grid from one run, steps
    alternating, and the report says its ratios were measured in one run."""
    from gqakit.eval.results import EvalResult
    from gqakit.eval.report import build_report, render_markdown
    from gqakit.eval.speed import evaluate_speed_together
    from gqakit.eval.provenance import model_info, run_info

    paths = {"mha": tiny_model("llama", num_key_value_heads=8), "gqa": tiny_model("llama", num_key_value_heads=2)}
    models = {n: load_causal_lm(p) for n, p in paths.items()}
    got = evaluate_speed_together(models, SMALL, device="cpu", dtype=torch.float32, progress=False)
    assert set(got) == {"mha", "gqa"}
    for n, res in got.items():
        assert res.settings["timed_with"] == ["mha", "gqa"] and "alternating" in res.settings["timing"]
        assert [(g.batch, g.prompt_len, g.status) for g in res.grid] == [(1, 16, "ok"), (2, 16, "ok")]
        assert all(g.decode_samples == SMALL.reps * SMALL.new_tokens for g in res.grid)  # one sample per step
    assert got["gqa"].kv_bytes_per_token * 4 == got["mha"].kv_bytes_per_token
    results = []
    for n, p in paths.items():
        r = EvalResult(schema="gqakit.eval/1", run=run_info(command=["test"], device="cpu", dtype=torch.float32),
                       model=model_info(models[n], p, 4))
        r.speed = got[n]
        results.append(r)
    rep = build_report(results, list(paths), command=["test"])
    assert rep["speed_timed_together"] is True
    assert "timed in one run" in render_markdown(rep, [])
    with pytest.raises(GqakitError, match="fast path only"):
        evaluate_speed_together(models, SpeedSettings(batches=(1,), prompt_lens=(16,), new_tokens=2, eager=True),
                                device="cpu", dtype=torch.float32, progress=False)


def test_speed_flags_default_to_the_settings_defaults():
    """`gqakit eval --speed` with no grid flags runs SpeedSettings() (one default per setting),
    and the settings refuse bad values in one line naming the flag, and unknown keys."""
    from pydantic import ValidationError

    import click

    from gqakit.eval.cli import eval_cmd

    ctx = click.Context(eval_cmd)
    flags = {p.name: p.get_default(ctx) for p in eval_cmd.params}
    cli = SpeedSettings(batches=flags["batches"], prompt_lens=flags["prompt_lens"], new_tokens=flags["new_tokens"],
                        reps=flags["reps"], warmup=flags["warmup"], max_batch_limit=flags["max_batch_limit"])
    assert cli == SpeedSettings()
    switches = {"compile_": "compile", "eager": "eager", "prefill_once": "prefill_once",
                "max_batch_search": "max_batch_search"}
    assert all(flags[f] is False and SpeedSettings.model_fields[k].default is False for f, k in switches.items())
    assert SpeedSettings(batches="1, 8", prompt_lens=(16,)).batches == (1, 8)
    for kw, msg in [({"batches": "1,x"}, "--batch must be comma-separated"), ({"prompt_lens": "0"}, "--prompt-len"),
                    ({"reps": 0}, "--reps"), ({"warmup": -1}, "--warmup"), ({"max_batch_limit": 0}, "--max-batch-limit")]:
        with pytest.raises(GqakitError, match=msg):
            SpeedSettings(**kw)
    with pytest.raises(ValidationError, match="new_token"):
        SpeedSettings(new_token=4)
