"""Decode speed of encoder-decoders (`gqakit eval --speed`): the grid batch x input length x
output length on pico T5 and BART, the bytes a step reads (both caches), the results file
and `gqakit compare`, and the settings' one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from gqakit.core.errors import GqakitError
from gqakit.eval.results import SCHEMA, EvalResult, read_results, write_results
from gqakit.eval.report import write_report
from gqakit.eval.report_speed import speedup_text
from gqakit.eval.speed import Seq2SeqBench, SpeedSettings, evaluate_speed
from tests.tiny_models import build_seq2seq
from tests.tolerance import assert_close_by_rounding

GRID = SpeedSettings(batches=(1, 2), input_lens=(12,), output_lens=(1, 3), new_tokens=3, reps=2, warmup=1)


def load(folder: Path):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()


def grouped_t5(folder: Path, kv_heads: int, **overrides) -> Path:
    """The pico T5 1.1 (config `overrides` applied) as gqakit's grouped T5 class, random
    weights, `kv_heads` KV heads."""
    from transformers import AutoConfig

    from gqakit.convert.remote.gqakit_modeling_t5 import GqakitT5Config, GqakitT5ForConditionalGeneration

    src = build_seq2seq("t5_v1_1", folder.with_name(folder.name + "-src"), **overrides)
    keys = {k: v for k, v in AutoConfig.from_pretrained(src).to_dict().items()
            if k not in ("model_type", "architectures", "transformers_version", "auto_map")}
    torch.manual_seed(1)
    GqakitT5ForConditionalGeneration(GqakitT5Config(**keys, num_key_value_heads=kv_heads)).save_pretrained(folder)
    return folder


def t5_step_path_length(config, self_positions: int, cross_positions: int) -> int:
    """The reduction lengths a T5 decoder step chains from its input to the logits (see
    tests/tolerance.py): per block, the self-attention (q/k/v projection over d_model, scores
    over d_kv, the weighted sum over the cached positions, the output projection over
    heads x d_kv), the cross-attention (the same over the encoder positions), the MLP (d_model,
    then d_ff) and three RMS norms (d_model each); then the final norm and the head (d_model)."""
    d, inner = config.d_model, config.num_heads * config.d_kv
    attention = d + config.d_kv + inner
    block = 2 * attention + self_positions + cross_positions + d + config.d_ff + 3 * d
    return config.num_decoder_layers * block + 2 * d


def step_weight_params(model, kind: str) -> int:
    """Parameters a decode step reads, counted by name: the decoder without its embeddings
    (lookups) and without the cross-attention K/V projections (applied once per point), plus
    the LM head."""
    cross_kv = (".EncDecAttention.k.", ".EncDecAttention.v.") if kind != "bart" else (".encoder_attn.k_proj.",
                                                                                      ".encoder_attn.v_proj.")
    n = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        lookup = any(k in name for k in ("embed_tokens", "embed_positions", "relative_attention_bias"))
        if lookup or not name.startswith(("decoder.", "model.decoder.")):
            continue
        n += 0 if any(k in name for k in cross_kv) else p.numel()
    return n + model.get_output_embeddings().weight.numel()


@pytest.mark.parametrize("kind", ["t5_v1_1", "bart"])
def test_step_bytes_include_the_cross_attention_cache(tmp_path: Path, kind: str) -> None:
    """Every grid point's predicted bytes: the decoder's weights, the self-attention cache at
    the output position and the cross-attention cache of the whole input (written out here
    from the config), and the caches the point allocated are that size."""
    folder = build_seq2seq(kind, tmp_path / kind)
    model = load(folder)
    cfg = json.loads((folder / "config.json").read_text())
    layers = cfg.get("num_decoder_layers") or cfg["decoder_layers"]
    heads = cfg.get("num_heads") or cfg["decoder_attention_heads"]
    d_kv = cfg.get("d_kv") or cfg["d_model"] // heads
    res = evaluate_speed(model, GRID, device="cpu", dtype=torch.float32, progress=False)
    assert [g.key for g in res.grid] == [(1, 12, 1), (2, 12, 1), (1, 12, 3), (2, 12, 3)]
    weights = 4 * step_weight_params(model, kind)
    assert res.weight_bytes_per_step == weights
    for g in res.grid:
        assert g.ok, g.reason
        cross = 2 * layers * heads * d_kv * 12 * 4 * g.batch
        own = 2 * layers * heads * d_kv * (g.output_len + (3 + 1) / 2) * 4 * g.batch
        b = g.bytes_per_step
        assert b["cross_attention_kv"] == cross and b["self_attention_kv"] == own
        assert b["total"] == weights + cross + own
        assert g.kv_cache_bytes == g.kv_cache_bytes_analytic == 2 * layers * heads * d_kv * 4 * g.batch * (
            12 + g.output_len + 3)
        assert g.encode_ms["median"] > 0 and g.prefill_ms["median"] >= g.encode_ms["median"]
    assert res.kv_bytes_per_input_token == 2 * layers * heads * d_kv * 4
    assert "cross-attention" in res.attention["decode_path"]


@pytest.mark.parametrize("kind", ["t5", "t5_v1_1", "mt5", "g1", "bart"])
def test_steps_give_the_models_own_tokens(tmp_path: Path, kind: str) -> None:
    """The timed steps (both caches, the fast path's packed weights, the lean T5 step where it
    applies) produce the greedy tokens of the model's own uncached forward, and a rewound
    repetition the same tokens again."""
    model = load(grouped_t5(tmp_path / kind, 1) if kind == "g1" else build_seq2seq(kind, tmp_path / kind))
    bench = Seq2SeqBench(model, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    inputs = torch.randint(3, 60, (2, 10))
    got = bench.generate(inputs, 1, 5)
    with torch.inference_mode():
        seq = torch.full((2, 1), bench.start)
        for _ in range(5):
            nxt = model(input_ids=inputs, decoder_input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(got, seq[:, 1:])
    pt = bench.open_point(2, 10, 4, 0, output_len=2)
    again = []
    for _ in range(2):
        bench.begin_rep(pt)
        for _ in range(4):
            bench.timed_step(pt)
        again.append(pt.cur)
    assert torch.equal(again[0], again[1])
    assert bench.close_point(pt, {"copy_bandwidth": 1e10, "matmul_flops": 1e11, "ridge_flops_per_byte": 10}).ok


@pytest.mark.numerics
@pytest.mark.parametrize("compiled", ["prepared", "compiled", "tensor-ops"],
                         ids=["one-call-per-block-keys-laid-out", "one-call-per-block", "tensor-ops"])
@pytest.mark.parametrize("kind", ["t5", "t5_v1_1", "mt5", "g2", "g1", "g2-12heads", "g1-12heads"])
def test_lean_t5_step_matches_the_models_own_step(tmp_path: Path, kind: str, compiled: str) -> None:
    """Step by step from equally filled caches: the lean T5 step, as tensor operations and as
    one compiled call per block (with the cross-attention keys as they are, and laid out once
    by `prepare`), gives the model's logits and leaves both caches as the model's own step
    does (T5 1.0 with its ReLU MLP and tied, scaled head; 1.1 and mT5 with gated GELU; gqakit's
    grouped T5, also with 12 heads of 16 at 2 and 1 KV heads: 6 and 12 query rows per K/V
    head: the kernel's transposed-keys path, with the position bias per row)."""
    from transformers.modeling_outputs import BaseModelOutput

    from gqakit.runtime import kernels
    from gqakit.runtime.t5_step import T5Step

    wide = dict(num_heads=12, d_kv=16) if kind.endswith("12heads") else {}
    folder = (grouped_t5(tmp_path / kind, int(kind[1]), **wide) if kind.startswith("g")
              else build_seq2seq(kind, tmp_path / kind))
    model = load(folder)
    bench = Seq2SeqBench(model, device="cpu", dtype=torch.float32)
    assert bench.lean is not None and "lean T5" in bench.decode_mode, bench.lean_note
    if compiled != "tensor-ops":
        if kernels.load() is None:
            pytest.skip(f"no compiled kernels here: {kernels.why_unavailable()}")
        assert bench.lean.kernels is not None, bench.lean.fused_note
        step = bench.lean
    else:
        step = T5Step(model)
        assert step.kernels is None
    torch.manual_seed(3)
    with torch.inference_mode():
        # with 12 heads: a prefix and an input over 16 positions (whole blocks of the one-pass path, then a tail)
        n_in, n_pre = (37, 18) if wide else (9, 2)
        encoded = BaseModelOutput(last_hidden_state=model.get_encoder()(input_ids=torch.randint(3, 60, (2, n_in)))[0])
        caches = [bench.new_cache(n_pre + 6, n_in) for _ in range(2)]
        prefix = torch.randint(3, 60, (2, n_pre))
        for c in caches:
            model(encoder_outputs=encoded, decoder_input_ids=prefix, **{bench.cache_kw: c}, use_cache=True)
        if compiled == "prepared":  # laid out where 6 or more query heads share a K/V head (AVX-512)
            assert step.prepare(caches[1]) == (bool(wide) and kernels.load().key_blocks(
                caches[1].cross_attention_cache.layers[0].keys.contiguous(), 12).numel() > 0)
        for _ in range(4):
            tok = torch.randint(3, 60, (2, 1))
            ref = model(encoder_outputs=encoded, decoder_input_ids=tok, **{bench.cache_kw: caches[0]},
                        use_cache=True).logits
            got = step(tok, caches[1]).logits
            # the same float32 sums in another order (SIMD width, blocking): rounding alone; a
            # position bias one slot off or a wrong head is off by ~1e-1
            assert_close_by_rounding(got, ref, t5_step_path_length(model.config, n_pre + 4, n_in))
    for a, b in zip(caches[0].self_attention_cache.layers, caches[1].self_attention_cache.layers):
        assert int(a.cumulative_length) == int(b.cumulative_length) == n_pre + 4
        # a cache entry is a projection of a layer's input: at most the whole path before it
        n = t5_step_path_length(model.config, n_pre + 4, n_in)
        assert_close_by_rounding(b.keys, a.keys, n)
        assert_close_by_rounding(b.values, a.values, n)


def test_lean_step_is_checked_and_names_why_it_does_not_apply(tmp_path: Path) -> None:
    from gqakit.runtime.t5_step import T5Step, check_t5_step

    t5 = load(build_seq2seq("t5_v1_1", tmp_path / "t5"))
    bench = Seq2SeqBench(t5, device="cpu", dtype=torch.float32)
    for kernels in (None, bench.kernels):
        wrong = T5Step(t5, kernels=kernels)
        wrong.scale_out = 0.5  # a head scale T5 1.1 does not have
        why = check_t5_step(t5, wrong, bench.new_cache, bench.vocab, bench.start, cache_kw=bench.cache_kw)
        assert why is not None and why.startswith("the lean T5 step gave other logits than the model")
    if bench.kernels is not None:  # an MLP the compiled block does not compute: the tensor-op step, and why
        t5.config.dense_act_fn = "relu"  # gated ReLU
        plain = T5Step(t5, kernels=bench.kernels)
        assert plain.kernels is None and plain.fused_note.startswith("an MLP the compiled block does not compute")
    bart = Seq2SeqBench(load(build_seq2seq("bart", tmp_path / "bart")), device="cpu", dtype=torch.float32)
    assert bart.lean is None and "covers the T5 layout" in bart.lean_note
    assert "the lean T5 step does not apply" in bart.probe()["layers"]
    eager = Seq2SeqBench(t5, device="cpu", dtype=torch.float32, pack_weights=False, fold_attention=False)
    assert eager.lean is None and "model's own decoder step" in eager.decode_mode


def test_results_round_trip_and_compare_shows_measured_beside_predicted(tmp_path: Path) -> None:
    """The grid of an MHA T5 and its grouped version: the results files read back byte for
    byte, and compare puts each point's measured speedup beside the bytes' prediction (the
    grouped model's smaller caches)."""
    from gqakit.eval.provenance import model_info, run_info

    paths = []
    models = {"mha": build_seq2seq("t5_v1_1", tmp_path / "mha"), "g1": grouped_t5(tmp_path / "g1", 1)}
    for name, folder in models.items():
        model = load(folder)
        bench_heads = Seq2SeqBench(model, device="cpu", dtype=torch.float32).kv_heads
        assert bench_heads == (4 if name == "mha" else 1)
        res = EvalResult(schema=SCHEMA, run=run_info(command=["test"], device="cpu", dtype=torch.float32),
                         model=model_info(model, folder, 4),
                         speed=evaluate_speed(model, GRID, device="cpu", dtype=torch.float32, progress=False))
        if name == "g1":  # one KV head: both attentions fold the query heads per KV head, nothing repeated
            from gqakit.runtime import kernels

            assert res.speed.attention["kv_copied"] is False
            fused = "grouped fused CPU kernel decode attention: query heads as rows of their K/V head"
            if kernels.load() is not None:  # the compiled T5 block: both attentions in the kernel
                assert res.speed.attention["self_attention"]["decode_path"].startswith(fused)
                assert res.speed.attention["cross_attention"]["decode_path"].startswith(fused)
                assert "one compiled call per block" in res.speed.attention["layers"]
            else:
                for site in ("self_attention", "cross_attention"):
                    assert res.speed.attention[site]["decode_path"].startswith("SDPA with query heads folded")
        out = write_results(res, tmp_path / f"{name}.json")
        text = out.read_text()
        back = read_results(out)
        assert json.dumps(back.to_json(), indent=2) + "\n" == text
        assert [g.key for g in back.speed.grid] == [g.key for g in res.speed.grid]
        paths.append(out)
    report = write_report(paths, tmp_path / "report", command=["test"])
    row = report["rows"][1]
    base, grouped = (read_results(p).speed.points() for p in paths)
    for key, g in grouped.items():
        e = row["speed"]["b{}_p{}_o{}".format(*key)]
        assert e["output_len"] == key[2]
        assert e["predicted_speedup_bytes"] == pytest.approx(base[key].bytes_per_step["total"]
                                                             / g.bytes_per_step["total"])
        assert e["predicted_speedup_bytes"] > 1
        assert e["speedup"] == pytest.approx(g.tokens_per_s["median"] / base[key].tokens_per_s["median"])
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Decode speed, its spread, and the prediction" in md
    e = row["speed"]["b2_p12_o3"]
    line = next(x for x in md.splitlines() if x.startswith("| g1 | 2 | 12, output 3 | "))
    lo, hi = e["speedup_interval"]
    assert f"| {speedup_text(e)} | {lo:.2f}–{hi:.2f}× | {e['predicted_speedup_bytes']:.2f}×" in line
    assert "tok/s b2 p12 o3" in md and "o the output length" in md


def test_eval_speed_on_an_encoder_decoder_from_the_command_line(tmp_path: Path, capsys) -> None:
    """`gqakit eval T5 --speed --input-len --output-len` writes the grid, the encoder's time and
    both caches' bytes per point, and says which path ran."""
    from gqakit.cli import main

    folder = build_seq2seq("t5", tmp_path / "t5")
    out = tmp_path / "t5.json"
    try:
        main(["eval", str(folder), "--speed", "--batch", "2", "--input-len", "8,16", "--output-len", "2",
              "--new-tokens", "2", "--reps", "1", "--warmup", "0", "--out", str(out), "-q"])
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    res = read_results(out)
    assert [g.key for g in res.speed.grid] == [(2, 8, 2), (2, 16, 2)]
    assert res.speed.settings["input_lens"] == [8, 16] and res.speed.settings["output_lens"] == [2]
    assert all(g.ok and g.encode_ms["median"] > 0 and g.bytes_per_step["cross_attention_kv"] > 0
               for g in res.speed.grid)
    assert res.speed.grid[1].bytes_per_step["cross_attention_kv"] == 2 * res.speed.grid[0].bytes_per_step[
        "cross_attention_kv"]
    assert res.speed.grid[0].decode_path["layers"].startswith("the lean T5 decoder step")
    printed = capsys.readouterr().out
    assert "batch    2 input     8 output    2: prefill" in printed


def test_bad_settings_are_one_line_errors(tmp_path: Path, capsys) -> None:
    """Bad axes name their flag; an axis for the other kind of model, --compile and
    --max-batch-search on an encoder-decoder, and inputs longer than BART's positions are
    refused in one line (on the command line, before the model loads)."""
    from gqakit.cli import main
    from tests.tiny_models import build

    for kw, msg in [({"input_lens": "0"}, "--input-len must be positive"),
                    ({"output_lens": "1,x"}, "--output-len must be comma-separated")]:
        with pytest.raises(GqakitError, match=msg):
            SpeedSettings(**kw)
    with pytest.raises(GqakitError, match="--input-len and --output-len are for encoder-decoder models"):
        SpeedSettings(input_lens=(8,)).check_model(False)
    SpeedSettings(prompt_lens=(8,)).check_model(False)
    with pytest.raises(GqakitError, match="--prompt-len is for decoder-only models"):
        SpeedSettings(prompt_lens=(8,)).check_model(True)
    with pytest.raises(GqakitError, match="--compile and --max-batch-search are for decoder-only"):
        SpeedSettings(max_batch_search=True).check_model(True)
    bart = build_seq2seq("bart", tmp_path / "bart")  # 128 learned positions
    with pytest.raises(GqakitError, match="input length 200 exceeds the encoder's 128 positions"):
        evaluate_speed(load(bart), SpeedSettings(input_lens=(200,)), device="cpu", dtype=torch.float32,
                       progress=False)
    llama = build("llama", tmp_path / "llama")
    for model, args, msg in [(bart, ["--prompt-len", "16"], "--prompt-len is for decoder-only models"),
                             (llama, ["--input-len", "16"], "--input-len and --output-len are for encoder-decoder")]:
        capsys.readouterr()  # what building the models printed
        with pytest.raises(SystemExit) as e:
            main(["eval", str(model), "--speed", *args, "--out", str(tmp_path / "r.json")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()


def test_flag_help_states_the_settings_defaults() -> None:
    """--input-len and --output-len default to SpeedSettings' own values (the help says so)."""
    from click.testing import CliRunner

    from gqakit.eval.cli import eval_cmd

    text = " ".join(CliRunner().invoke(eval_cmd, ["--help"]).output.split())
    for flag, field in (("--input-len", "input_lens"), ("--output-len", "output_lens")):
        default = ",".join(map(str, SpeedSettings.model_fields[field].default))
        assert re.search(rf"{flag} TEXT [^[]*\[default: ([^\]]*)\]", text).group(1) == default
