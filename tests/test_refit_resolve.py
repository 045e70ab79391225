"""align-refit's settings are decided before the calibration stage: after resolution no option
holds "auto", on the CPU and on a GPU (a fake CUDA device with a given free memory), and the
stage only reads them."""

from __future__ import annotations

import pytest

from gqakit.convert.refit_options import RefitOptions
from gqakit.convert.resolved import Device, device_facts, resolve_settings
from gqakit.convert.settings import ConvertSettings
from gqakit.core import device as devices
from gqakit.core.errors import GqakitError
from gqakit.core.methods import METHODS

GIB = 2**30
AUTO_KEYS = [k for k, f in RefitOptions.model_fields.items() if f.default == "auto"]


def _fields(options) -> dict:
    return {k: getattr(options, k) for k in type(options).model_fields}


@pytest.mark.parametrize("device", [Device("cpu", 64 * GIB, 64 * GIB), Device("cuda", 70 * GIB, 64 * GIB)])
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("params", [300_000, 135_000_000])
def test_no_option_is_auto_after_resolution(method, params, device):
    for effort in ("best", "fast"):
        s = ConvertSettings(source="m", num_kv_heads=1, method=method, effort=effort)
        r = resolve_settings(s, source_params=params, max_positions=2048, device=device, hidden=576, layers=30)
        assert r.grouping != "auto"
        if METHODS[method].options is None:
            continue
        left = [k for k, v in _fields(r.options).items() if v == "auto"]
        assert left == [], f"{method}: still auto after resolution: {left}"
        assert set(AUTO_KEYS) <= set(r.reasons)  # each decided with its reason
        assert all(r.record()["options"][k] == getattr(r.options, k) for k in AUTO_KEYS)


def test_the_device_decides_batch_dtype_and_where_the_streams_go(monkeypatch):
    s = ConvertSettings(source="m", num_kv_heads=1, method="align-refit", calibration_tokens=65536)
    # SmolLM2's width: 2 streams x 65,536 tokens x 576 x 4 bytes = 0.28 GiB
    free = {"cuda": 40 * GIB, "cpu": 64 * GIB}
    monkeypatch.setattr(devices, "available_memory", lambda d: free[str(d).split(":")[0]])
    gpu = resolve_settings(s, source_params=135_000_000, max_positions=8192, device=device_facts("cuda"),
                           hidden=576, layers=30).options
    assert (gpu.batch, gpu.dtype, gpu.stream_dtype, gpu.offload) == (4, "float32", "float32", "device")
    cpu = resolve_settings(s, source_params=135_000_000, max_positions=8192, device=device_facts("cpu"),
                           hidden=576, layers=30).options
    assert (cpu.batch, cpu.offload) == (1, "cpu")  # one 512-token sequence per step
    free["cuda"] = GIB // 4  # streams do not fit next to the blocks: host memory
    assert resolve_settings(s, source_params=135_000_000, max_positions=8192, device=device_facts("cuda"),
                            hidden=576, layers=30).options.offload == "cpu"
    free["cpu"] = GIB // 4  # nor in half the host's free memory: disk
    assert resolve_settings(s, source_params=135_000_000, max_positions=8192, device=device_facts("cuda"),
                            hidden=576, layers=30).options.offload == "disk"
    small = resolve_settings(s, source_params=300_000, max_positions=256, device=Device("cpu", GIB, GIB),
                             hidden=64, layers=5).options
    # a small model on the CPU: at most 1,024 tokens per batch (two sequences cost little more than one)
    assert (small.batch, small.dtype) == (4, "float64")  # 256-token sequences
    assert resolve_settings(s, source_params=300_000, max_positions=512, device=Device("cpu", GIB, GIB),
                            hidden=64, layers=5).options.batch == 2
    assert resolve_settings(s, source_params=300_000, max_positions=512, device=Device("cuda", GIB, GIB),
                            hidden=64, layers=5).options.batch == 4  # a GPU: 2,048 tokens
    # the steps and the passes: float32 and float64 for a small model, bfloat16 where it is native
    assert small.step_dtype == "float32"
    for bf16, want in ((True, "bfloat16"), (False, "float32")):
        got = resolve_settings(s, source_params=135_000_000, max_positions=8192,
                               device=Device("cpu", 64 * GIB, 64 * GIB, bf16), hidden=576, layers=30)
        assert got.options.step_dtype == want and "bfloat16" in got.reasons["step_dtype"]
        assert got.options.dtype == want and "bfloat16" in got.reasons["dtype"]
        assert got.options.stream_dtype == "float32"  # bfloat16 passes keep float32 streams
    asked = ConvertSettings(source="m", num_kv_heads=1, method="align-refit", refit={"dtype": "bfloat16"})
    got = resolve_settings(asked, source_params=135_000_000, max_positions=8192,
                           device=Device("cpu", 64 * GIB, 64 * GIB, True), hidden=576, layers=30)
    assert (got.options.dtype, got.options.stream_dtype) == ("bfloat16", "float32")


@pytest.mark.parametrize("key", ["dtype", "step_dtype"])
def test_bfloat16_asked_for_where_it_is_emulated_says_so(key):
    """A CPU without native bfloat16 multiplies it many times slower than float32: asked for anyway, it
    is kept, and the settings line says what it costs; on a CPU with it, or not asked for, no word."""
    asked = ConvertSettings(source="m", num_kv_heads=1, method="align-refit", refit={key: "bfloat16"})
    for bf16 in (False, True):
        got = resolve_settings(asked, source_params=135_000_000, max_positions=8192,
                               device=Device("cpu", 64 * GIB, 64 * GIB, bf16), hidden=576, layers=30)
        assert getattr(got.options, key) == "bfloat16"
        assert ("no native bfloat16" in got.reasons.get(key, "")) is not bf16
    other = "step_dtype" if key == "dtype" else "dtype"
    plain = resolve_settings(asked, source_params=135_000_000, max_positions=8192,
                             device=Device("cpu", 64 * GIB, 64 * GIB, False), hidden=576, layers=30)
    assert plain.reasons[other].startswith("auto: float32")


def test_resolved_settings_refuse_options_left_auto():
    from gqakit.convert.resolved import ResolvedSettings

    s = ConvertSettings(source="m", num_kv_heads=1, method="align-refit")
    with pytest.raises(GqakitError, match="still auto") as e:
        ResolvedSettings(s, "contiguous", RefitOptions(), "folder", None, 2 * 10**9)
    assert all(k in str(e.value) for k in AUTO_KEYS)


@pytest.mark.parametrize("key", ["batch", "seq_len", "steps", "lr"])
def test_auto_is_a_value_and_a_bad_value_is_one_line(key):
    assert getattr(RefitOptions.parse({key: "auto"}), key) == "auto"
    for bad in ("x", -1, 0.5 if key != "lr" else 0):
        with pytest.raises(GqakitError) as e:
            RefitOptions.parse({key: bad})
        assert "\n" not in str(e.value) and key in str(e.value)


@pytest.mark.parametrize("step_dtype", ["float64", "float32", "bfloat16"])
def test_the_steps_compute_in_step_dtype(tiny_model, tmp_path, monkeypatch, step_dtype):
    """The reconstruction steps see their inputs in `step_dtype` (bfloat16: autocast over float32),
    and the trained block weights go back to the block's compute dtype (float64 for a small model)."""
    import json

    import torch

    from gqakit.convert.pipeline import convert_checkpoint

    seen = []

    def spy(module, args):  # a decoder block's input (positional here) in a training step (gradients on)
        if torch.is_grad_enabled() and type(module).__name__.endswith("DecoderLayer"):
            seen.append((args[0].dtype, torch.is_autocast_enabled("cpu")))

    hook = torch.nn.modules.module.register_module_forward_pre_hook(spy)
    try:
        src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=2)
        out = convert_checkpoint(src, tmp_path / "out", 2, "align-refit", calibration_tokens=256, progress=False,
                                 device="cpu", options={"seq_len": 32, "steps": 4, "step_dtype": step_dtype})
    finally:
        hook.remove()
    autocast = step_dtype == "bfloat16"
    want = torch.float32 if autocast else getattr(torch, step_dtype)
    assert seen and set(seen) == {(want, autocast)}
    cal = json.loads((out / "gqakit_convert.json").read_text())["calibration"]
    assert cal["compute_dtype"] == "float64" and cal["options"]["step_dtype"] == step_dtype
    assert len(cal["reconstruction"]) == 2


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_the_block_passes_compute_in_dtype(tiny_model, tmp_path, dtype):
    """The passes over the calibration spans (the fits' rows, both streams' advance) see the streams in
    `dtype`'s storage dtype, bfloat16 as autocast over float32 weights and streams; the steps keep
    their own `step_dtype`."""
    import json

    import torch

    from gqakit.convert.pipeline import convert_checkpoint

    seen = []

    def spy(module, args):  # a decoder block's input in a pass (no gradients) of the calibration
        if not torch.is_grad_enabled() and type(module).__name__.endswith("DecoderLayer"):
            seen.append((args[0].dtype, torch.is_autocast_enabled("cpu")))

    src = tiny_model("llama", num_key_value_heads=4, num_hidden_layers=2)
    data = tmp_path / "calib.txt"  # given text: no sampling from the model before the passes
    data.write_text("abc def ghi jkl mno pqr stu vwx yz " * 200)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(spy)
    try:
        out = convert_checkpoint(src, tmp_path / "out", 2, "align-refit", calibration_data=str(data),
                                 calibration_tokens=256, progress=False, device="cpu",
                                 options={"seq_len": 32, "steps": 0, "dtype": dtype})
    finally:
        hook.remove()
    autocast = dtype == "bfloat16"
    want = torch.float32 if autocast else getattr(torch, dtype)
    if autocast:  # the blocks' inputs are recorded first, in float32 (no block computes in them)
        first = [a for _, a in seen].index(True)
        assert set(seen[:first]) == {(torch.float32, False)}
        seen = seen[first:]
    assert seen and set(seen) == {(want, autocast)}
    cal = json.loads((out / "gqakit_convert.json").read_text())["calibration"]
    assert cal["compute_dtype"] == dtype and cal["stream_dtype"] == str(want).replace("torch.", "")
    assert cal["options"]["dtype"] == dtype
