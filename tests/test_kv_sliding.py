"""KV-cache predictions that know sliding-window layers: a sliding layer's cache holds
min(window, capacity) positions in transformers' static cache (the transformers and gqakit
engines), so the serving check predicts each layer at the check's capacity; which layers slide
is read off the config as transformers reads it, with the family's rule from the architecture
table for a config.json that has no `layer_types`; a decode step at depth D reads min(window, D)
positions of a sliding layer."""

from __future__ import annotations

import json
import types

import pytest

from cli_helpers import run_cli
from gqakit.core import arch
from gqakit.core.errors import GqakitError
from gqakit.core.geometry import Shape
from gqakit.core.loaded import loaded_shape
from gqakit.core.windows import SlidingWindow, layer_windows_of
from gqakit.engines.base import KvAllocation
from gqakit.engines.check import held_positions, kv_check, predicted_cache_bytes, table
from gqakit.eval.speed.point import OpenPoint, step_cost
from test_kv_plan import convert, plan_file

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW, LAYERS = 16, 4  # the pico Gemma 2's window; layers 0 and 2 slide, 1 and 3 are full


# ----------------------------------------------------------------------------- the geometry

@pytest.mark.parametrize("capacity", [5, WINDOW, 40])  # shorter than the window, equal, longer
def test_cache_bytes_hold_min_window_capacity_in_sliding_layers(capacity):
    s = Shape(LAYERS, 8, 2, 8, 64, 8, 128, None, (WINDOW, None, WINDOW, None))
    per_layer = 2 * 2 * 8 * 4  # K and V, 2 KV heads, head_dim 8, float32
    assert s.kv_cache_bytes(4, capacity) == per_layer * (2 * capacity + 2 * min(WINDOW, capacity))
    # a token within the window costs every layer
    assert s.kv_bytes_per_token(4) == LAYERS * per_layer
    assert s.window_shares() == {WINDOW: 0.5}
    # per-layer KV heads weight the layers
    assert s.kv_cache_bytes(4, capacity, [8, 1, 8, 2]) == 2 * 8 * 4 * ((8 + 8) * min(WINDOW, capacity)
                                                                        + (1 + 2) * capacity)
    assert s.window_shares([8, 1, 8, 2]) == {WINDOW: 16 / 19}


def test_without_sliding_layers_the_cache_is_capacity_times_per_token():
    s = Shape(LAYERS, 8, 2, 8, 64, 8, 128)
    for capacity in (1, 40, 1000):
        assert s.kv_cache_bytes(4, capacity) == capacity * s.kv_bytes_per_token(4)
    assert s.window_shares() == {}


@pytest.mark.parametrize("capacity", [10, 40])
def test_check_prediction_holds_each_layers_positions(capacity):
    held = held_positions([WINDOW, None, WINDOW, None], capacity, LAYERS)
    assert held == [min(WINDOW, capacity), capacity, min(WINDOW, capacity), capacity]
    assert held_positions(None, capacity, 3) == [capacity] * 3
    assert predicted_cache_bytes([2, 2, 2, 2], 8, 4, held) == 2 * 2 * 8 * 4 * sum(held)


# ----------------------------------------------------------------------------- the family rules

def gemma2_dict(**o):
    return {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": LAYERS,
            "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 32, "head_dim": 8, **o}


def qwen_dict(**o):
    return {**gemma2_dict(), "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **o}


def test_family_rules_read_a_config_json_without_layer_types():
    """Each family's rule as transformers' config class applies it (Gemma 2: every other layer,
    window 4096 by default; Qwen: from max_window_layers on, only with use_sliding_window;
    Mistral: every layer, 4096 by default; Phi-3: every layer where a window is set)."""
    spec = arch.lookup(gemma2_dict())
    assert arch.shape_of(spec, gemma2_dict(sliding_window=WINDOW)).layer_windows == (WINDOW, None, WINDOW, None)
    assert arch.shape_of(spec, gemma2_dict()).layer_windows == (4096, None, 4096, None)
    # layer_types, where a config states it, wins over the pattern
    typed = gemma2_dict(sliding_window=WINDOW, layer_types=["full_attention"] * 3 + ["sliding_attention"])
    assert arch.shape_of(spec, typed).layer_windows == (None, None, None, WINDOW)
    q = arch.lookup(qwen_dict())
    assert arch.shape_of(q, qwen_dict(sliding_window=WINDOW, max_window_layers=1)).layer_windows is None
    assert arch.shape_of(q, qwen_dict(sliding_window=WINDOW, max_window_layers=1, use_sliding_window=True)
                         ).layer_windows == (None, WINDOW, WINDOW, WINDOW)
    mistral = {**gemma2_dict(), "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    m = arch.lookup(mistral)
    assert arch.shape_of(m, mistral).layer_windows == (4096,) * LAYERS
    assert arch.shape_of(m, {**mistral, "sliding_window": None}).layer_windows is None
    llama = {**mistral, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert arch.shape_of(arch.lookup(llama), llama).layer_windows is None


@pytest.mark.parametrize("family,overrides", [
    ("gemma2", {"sliding_window": WINDOW}),
    ("qwen3", {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 2}),
    ("qwen2", {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1}),
    ("mistral", {"sliding_window": WINDOW}),
    ("phi3", {"sliding_window": WINDOW}),
    ("qwen3", {}), ("mistral", {}), ("llama", {})])
def test_table_rule_agrees_with_transformers_config_and_cache(tiny_model, family, overrides):
    """On a saved config.json without `layer_types` (the table's rule), on the loaded config
    and in transformers' StaticCache, the same layers slide with the same window."""
    from transformers import AutoConfig, StaticCache

    folder = tiny_model(family, num_hidden_layers=LAYERS, **overrides)
    cfg = AutoConfig.from_pretrained(folder)
    cache = StaticCache(config=cfg, max_cache_len=40)
    slides = [getattr(layer, "is_sliding", False) for layer in cache.layers]
    expected = tuple(WINDOW if s else None for s in slides) if any(slides) else None
    assert loaded_shape(cfg).layer_windows == expected
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("layer_types", None)
    assert arch.shape_of(arch.lookup(raw), raw).layer_windows == expected
    # the cases above slide where the caller set a window (Qwen: and turned it on)
    assert (expected is not None) == bool(overrides)


def test_rule_schema_and_bad_values():
    with pytest.raises(ValueError, match="period"):
        SlidingWindow(layers="periodic")
    with pytest.raises(ValueError, match="from_key"):
        SlidingWindow(layers="all", from_key="max_window_layers")
    with pytest.raises(GqakitError, match="layer_types must list"):
        layer_windows_of(None, {"sliding_window": 4, "layer_types": ["sliding_attention"]}, 2)
    with pytest.raises(GqakitError, match="sliding_window = 0"):
        layer_windows_of(None, {"sliding_window": 0}, 2)
    assert layer_windows_of(None, {}, 2) is None
    period = SlidingWindow(layers="periodic", period_key="sliding_window_pattern", period=2)
    assert layer_windows_of(period, {"sliding_window": 4, "sliding_window_pattern": 3}, 6) == (4, 4, None, 4, 4, None)


# ----------------------------------------------------------------------------- the check

def check(model, out, capsys, engine: str, *extra):
    code, stdout, err = run_cli(["eval", model, "--engine", engine, "--check", "--out", out,
                                 "--check-prompts", "2", "--check-tokens", "8", *extra], capsys)
    return code, stdout, err, json.loads(out.read_text())["serving"] if out.exists() else {}


@pytest.mark.parametrize("engine", ["transformers", "gqakit"])
def test_check_passes_on_sliding_layers_uniform_and_per_layer(tiny_model, tmp_path, capsys, engine):
    """Pico Gemma 2 (window 16, 4 layers, float32) at -g 2 and at the plan 8/1/8/2: the check's
    capacity (24 prompt + 8 generated tokens) exceeds the window, so the sliding layers hold 16
    positions and the full ones the capacity; a prediction of every layer at every position
    (the bytes per token of a model without sliding layers) fails this check."""
    src = tiny_model("gemma2", num_hidden_layers=LAYERS, sliding_window=WINDOW)
    outs = {"uniform": convert(src, tmp_path / "g2", num_kv_heads=2),
            "plan": convert(src, tmp_path / "plan", kv_plan=plan_file(tmp_path, [8, 1, 8, 2]))}
    for name, heads in (("uniform", [2, 2, 2, 2]), ("plan", [8, 1, 8, 2])):
        code, stdout, err, block = check(outs[name], tmp_path / f"check-{name}.json", capsys, engine)
        kv = block["kv"]
        cap = kv["capacity_tokens"]
        assert cap > WINDOW  # else the window would not cut anything
        assert kv["layer_windows"] == [WINDOW, None, WINDOW, None] and kv["windows_held"] is True
        held = [WINDOW, cap, WINDOW, cap]
        total = 2 * sum(h * p for h, p in zip(heads, held)) * 8 * 4
        assert kv["total_bytes"] == kv["predicted_total_bytes"] == total
        assert kv["allocated_bytes_per_token"] == kv["predicted_bytes_per_token"] == total // cap
        # fewer than every layer at every position
        assert total < cap * 2 * sum(heads) * 8 * 4
        assert code == 0 and block["passed"], (err, stdout)
        line = next(ln for ln in stdout.splitlines() if "KV bytes per token" in ln)
        assert f"2 of 4 layers slide (window {WINDOW}: each holds min(window, capacity) = {WINDOW})" in line
        assert line.endswith("ok")


def _cfg(tiny_model):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model("gemma2", num_hidden_layers=LAYERS, sliding_window=WINDOW))


class _Engine:
    def __init__(self, kv: KvAllocation) -> None:
        self.kv = kv

    def kv_allocation(self) -> KvAllocation:
        return self.kv


def test_check_fails_a_cache_that_holds_other_positions(tiny_model):
    cfg = _cfg(tiny_model)
    cap, per = 40, 2 * 8 * 8 * 4
    right = [WINDOW, cap, WINDOW, cap]
    total = per * sum(right)

    def alloc(positions, total=total):
        return KvAllocation(bytes_per_token=total // cap, capacity_tokens=cap, total_bytes=total,
                            detail={"cache_dtype": "float32", "positions_per_layer": positions})

    assert kv_check(_Engine(alloc(right)), cfg, "float32").match
    # the same bytes with the window in the full layers is not the prediction
    assert not kv_check(_Engine(alloc([cap, WINDOW, cap, WINDOW])), cfg, "float32").match
    # every layer at the capacity: the per-token bytes the old prediction expected, now wrong
    assert not kv_check(_Engine(alloc([cap] * 4, per * 4 * cap)), cfg, "float32").match


def test_an_engine_that_pages_every_layer_is_predicted_per_token(tiny_model):
    """vLLM reports pages per token of every layer, no positions per layer: predicted as before."""
    cfg = _cfg(tiny_model)
    per_token = 2 * 8 * 8 * 4 * LAYERS
    kv = kv_check(_Engine(KvAllocation(bytes_per_token=per_token, capacity_tokens=4096,
                                       total_bytes=4096 * per_token, detail={"cache_dtype": "float32"})),
                  cfg, "float32")
    assert kv.match and kv.predicted_bytes_per_token == per_token and not kv.windows_held
    check = types.SimpleNamespace(engine="vllm", prompts=1, new_tokens=1, prompt_source="text", positions=1,
                                  mismatches=[], agreement=1.0, margin_row="float32", margin=0.01,
                                  unexplained=0, max_abs_logprob_diff=None, kv=kv, passed=True, rule="r")
    line = next(ln for ln in table(check) if "KV bytes" in ln)
    assert "2 of 4 layers slide (window 16: paged per token as full layers)" in line


# ----------------------------------------------------------------------------- the speed bench

def test_a_decode_step_reads_min_window_depth_in_sliding_layers():
    shape = Shape(LAYERS, 8, 2, 8, 64, 8, 128, None, (WINDOW, None, WINDOW, None))
    per_token = shape.kv_bytes_per_token(4)
    bench = types.SimpleNamespace(weight_bytes=1000, matmul_params=10, kv_bytes_per_token=per_token,
                                  layers=LAYERS, heads=8, head_dim=8, kv_window_shares=shape.window_shares())
    pt = OpenPoint(2, 30, 4)  # steps at depths 31..34, past the window
    cost = step_cost(bench, pt)
    depths = range(31, 35)
    expected = 2 * sum(shape.kv_cache_bytes(4, d) for d in depths) / len(depths)
    assert cost.bytes["kv"] == pytest.approx(expected, rel=1e-12)  # float64 over four terms
    assert cost.kv_analytic == 2 * shape.kv_cache_bytes(4, 34)
    # a model without sliding layers: every layer at the mean depth, as before
    full = types.SimpleNamespace(**{**vars(bench), "kv_window_shares": {}})
    assert step_cost(full, pt).bytes["kv"] == 2 * per_token * (30 + 5 / 2)
    # steps within the window read every position
    short = step_cost(bench, OpenPoint(1, 4, 4))
    assert short.bytes["kv"] == pytest.approx(per_token * (4 + 5 / 2), rel=1e-12)
