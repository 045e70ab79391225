"""gqakit's vLLM engine (`gqakit.engines.vllm`): the client without vLLM, and, under the
`engines` marker, vLLM itself on a pico Llama folder and on SmolLM2-135M at one KV head.

vLLM lives in its own venv (`bash scripts/engines.sh vllm`); the `engines` tests skip when
neither $GQAKIT_VLLM_PYTHON nor `.venv-vllm` gives one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gqakit.core.errors import GqakitError
from gqakit.engines import EngineMissing, EngineOptions, get_engine
from gqakit.engines import vllm as ev
from tiny_models import build, build_seq2seq

# vLLM's KV-cache groups as its engine core reports them for SmolLM2-135M (30 layers, head_dim
# 64, float32, blocks of 128 tokens) at 3 and 1 KV heads, with 64 MiB of KV memory.
SMOL_G3 = {"num_blocks": 11, "tensor_bytes": 11 * 30 * 196608, "cache_dtype": "auto",
           "groups": [{"spec": "FullAttentionSpec", "layers": 30, "block_size": 128, "page_size_bytes": 196608,
                       "num_kv_heads": 3, "head_size": 64, "dtype": "float32"}]}
SMOL_G1 = {"num_blocks": 34, "tensor_bytes": 34 * 30 * 65536, "cache_dtype": "auto",
           "groups": [{**SMOL_G3["groups"][0], "page_size_bytes": 65536, "num_kv_heads": 1}]}


def convert(src: Path, out: Path, g: int) -> Path:
    from gqakit.convert import convert_checkpoint

    return Path(convert_checkpoint(src, out, g, progress=False))


# ----------------------------------------------------------------------------- without vLLM


def test_load_request_carries_the_options():
    opts = EngineOptions(dtype="bf16", max_len=300, kv_budget_bytes=64 << 20, max_batch=5)
    req = ev.load_request(Path("m"), opts, True)
    assert req == {"op": "load", "model": str(Path("m").resolve()), "dtype": "bfloat16", "max_len": 300,
                   "kv_budget_bytes": 64 << 20, "max_batch": 5, "trust_remote_code": True}
    assert ev.load_request(Path("m"), EngineOptions(), False)["kv_budget_bytes"] is None  # vLLM's default
    with pytest.raises(GqakitError, match="vLLM takes auto or one of"):
        ev.load_request(Path("m"), EngineOptions(dtype="float8_e5m2"), False)


def test_worker_env_keeps_the_engine_core_in_process_and_binds_threads():
    env = ev.worker_env(EngineOptions(threads=2), {"PYTHONPATH": "/x", "HOME": "/h"})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "PYTHONPATH" not in env and env["HOME"] == "/h"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in ev.worker_env(EngineOptions(), {})


def test_options_are_checked_where_they_are_built():
    with pytest.raises(GqakitError, match="max_len"):
        EngineOptions(max_len=0)
    with pytest.raises(ValueError):
        EngineOptions(kv_budgets=1)  # a misspelt option is refused, not ignored


def test_generation_reply_is_parsed_and_checked():
    g = ev.parse_generation({"tokens": [[5, 6], [7, 8]], "logprobs": [[-0.5, -1.0], [-2.0, -0.1]], "seconds": 1.5},
                            2, 2)
    assert g.tokens == [[5, 6], [7, 8]] and g.logprobs == [[-0.5, -1.0], [-2.0, -0.1]] and g.seconds == 1.5
    partial = ev.parse_generation({"tokens": [[5, 6]], "logprobs": [[-0.5]], "seconds": 0}, 1, 2)
    assert partial.logprobs is None  # never misaligned with the tokens
    with pytest.raises(GqakitError, match="tokens for 2 prompts"):
        ev.parse_generation({"tokens": [[5, 6], [7]], "logprobs": None, "seconds": 0}, 2, 2)


def test_kv_bytes_are_vllms_page_bytes_over_its_block_size():
    g3, g1 = ev.parse_kv(SMOL_G3), ev.parse_kv(SMOL_G1)
    # 2 (K, V) x 30 layers x KV heads x 64 x 4 bytes: 46,080 and 15,360
    assert (g3.bytes_per_token, g1.bytes_per_token) == (2 * 30 * 3 * 64 * 4, 2 * 30 * 1 * 64 * 4)
    assert (g3.capacity_tokens, g1.capacity_tokens) == (11 * 128, 34 * 128)
    assert g3.total_bytes == 11 * 30 * 196608 and g3.detail["block_size"] == 128
    # vLLM says "auto" (the model's dtype); the allocation reports what its cache holds, so the
    # serving check predicts with 4 bytes per value, as allocated
    from gqakit.engines.check import cache_bytes, predicted_kv_bytes

    assert g3.detail["cache_dtype"] == "float32"
    assert predicted_kv_bytes(3, 64, cache_bytes(g3.detail["cache_dtype"]), layers=30) == g3.bytes_per_token
    # a context of 160 tokens takes 2 blocks: 5.5 and 17 sequences at once
    assert (ev.max_concurrency(g3, 160), ev.max_concurrency(g1, 160)) == (5.5, 17.0)
    assert ev.max_concurrency(g3, 128) == 11.0


def test_kv_reply_with_two_block_sizes_or_no_cache_is_refused():
    two = {**SMOL_G3, "groups": [SMOL_G3["groups"][0], {**SMOL_G3["groups"][0], "block_size": 64}]}
    with pytest.raises(GqakitError, match="several block sizes"):
        ev.parse_kv(two)
    with pytest.raises(GqakitError, match="no KV cache"):
        ev.parse_kv({**SMOL_G3, "groups": []})


def test_two_groups_sum_their_layers():
    two = {**SMOL_G3, "groups": [SMOL_G3["groups"][0], {**SMOL_G1["groups"][0], "layers": 2}]}
    assert ev.parse_kv(two).bytes_per_token == (30 * 196608 + 2 * 65536) // 128


def test_gguf_is_refused_with_the_pointer_to_llama_cpp(tmp_path):
    with pytest.raises(GqakitError, match="GGUF.*--engine llama.cpp"):
        ev.check_model(tmp_path / "model.Q4_1.gguf")
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(GqakitError, match="GGUF"):
        ev.check_model(tmp_path / "only")
    with pytest.raises(GqakitError, match="m.gguf is a GGUF file"):
        ev.load_request(tmp_path, EngineOptions(gguf_file="m.gguf"), False)


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(GqakitError, match="no config.json"):
        ev.check_model(tmp_path)


@pytest.mark.parametrize("family", ["gpt_neox", "opt"])
def test_a_gqakit_remote_code_output_is_refused_before_vllm_starts(tmp_path, family, monkeypatch):
    out = convert(build(family, tmp_path / "src"), tmp_path / "g2", 2)
    monkeypatch.setattr(ev, "find_python", lambda: pytest.fail("vLLM must not start"))
    with pytest.raises(GqakitError, match=r"needs gqakit's modeling file \(gqakit_modeling_.*--engine gqakit"):
        get_engine("vllm").load(out, EngineOptions())
    assert ev.check_model(tmp_path / "src") is False  # the stock folder itself loads in vLLM's own class


def test_an_encoder_decoder_is_refused(tmp_path):
    with pytest.raises(GqakitError, match="encoder-decoder"):
        ev.check_model(build_seq2seq("t5", tmp_path / "t5"))


def test_a_stock_folder_passes_without_remote_code(tmp_path):
    assert ev.check_model(build("llama", tmp_path / "l", num_key_value_heads=2)) is False


def test_not_installed_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(ev.ENV_PYTHON, sys.executable)  # gqakit's own python has no vllm
    with pytest.raises(EngineMissing) as e:
        get_engine("vllm").load(build("llama", tmp_path / "l"), EngineOptions())
    msg = e.value.one_line()
    assert msg.startswith("vLLM is not installed") and "scripts/engines.sh vllm" in msg and "\n" not in str(e.value)
    monkeypatch.setenv(ev.ENV_PYTHON, str(tmp_path / "no-python"))
    with pytest.raises(EngineMissing, match="is not a python with vllm"):
        ev.find_python()
    monkeypatch.delenv(ev.ENV_PYTHON)
    monkeypatch.setattr(ev, "VENV_PYTHON", Path(sys.executable))  # a .venv-vllm without vllm
    with pytest.raises(EngineMissing, match="has no vllm"):
        ev.find_python()
    (tmp_path / "vllm").mkdir()  # a folder named vllm on the path (a checkout) is not vLLM
    (tmp_path / "vllm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ev, "VENV_PYTHON", tmp_path / "none" / "python")
    with pytest.raises(EngineMissing, match=r"^vLLM is not installed: run `bash scripts/engines.sh vllm`"):
        ev.find_python()


def test_unknown_engine_lists_the_names():
    with pytest.raises(GqakitError, match="no engine named 'vlm'; engines: .*vllm"):
        get_engine("vlm")


def test_importing_the_client_imports_neither_torch_nor_vllm():
    code = ("import sys, gqakit.engines, gqakit.engines.vllm; "
            "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_worker_errors_come_back_as_one_line_and_close_stops_it(tmp_path, monkeypatch):
    """The worker under a python without vLLM: it imports vLLM (not the client module beside
    it, whose name is also `vllm`), fails, and the client raises that as one line."""
    monkeypatch.setattr(ev, "find_python", lambda: sys.executable)
    eng = get_engine("vllm")
    with pytest.raises(GqakitError, match=r"^vLLM: ModuleNotFoundError: No module named 'vllm'$"):
        eng.load(build("llama", tmp_path / "l"), EngineOptions())
    assert eng._proc is None  # closed on failure


def test_worker_protocol(tmp_path):
    reqs = [{"op": "generate", "prompts": [[1]], "max_new_tokens": 1}, {"op": "nope"}, {"op": "close"}]
    out = subprocess.run([sys.executable, str(ev.WORKER)], input="\n".join(map(json.dumps, reqs)) + "\n",
                         capture_output=True, text=True, timeout=60, env=ev.worker_env(EngineOptions()))
    replies = [json.loads(line) for line in out.stdout.splitlines()]
    assert replies == [{"ok": False, "error": "RuntimeError: no model is loaded"},
                       {"ok": False, "error": "ValueError: unknown op 'nope'"}, {"ok": True}]
    assert out.returncode == 0


# ----------------------------------------------------------------------------- with vLLM


def _vllm_python() -> str:
    try:
        return ev.find_python()
    except EngineMissing:
        pytest.skip("vLLM not found (bash scripts/engines.sh vllm, or GQAKIT_VLLM_PYTHON)")


def _teacher_forced_argmax(folder: Path, prompts: list[list[int]], tokens: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [lm(torch.tensor([p + t])).logits[0, len(p) - 1: len(p) - 1 + len(t)].argmax(-1).tolist()
                for p, t in zip(prompts, tokens)]


def _serve_and_compare(folder: Path, prompts: list[list[int]], new: int, kv_heads: int, layers: int,
                       head_dim: int, budget: int) -> None:
    eng = get_engine("vllm")
    eng.load(folder, EngineOptions(dtype="float32", max_len=128, kv_budget_bytes=budget, max_batch=4))
    try:
        gen = eng.generate(prompts, new)
        kv = eng.kv_allocation()
        proc = eng._proc
    finally:
        eng.close()
    assert proc is not None and proc.poll() is not None  # the worker is gone after close
    # float32 in both, summed in different orders: argmax equal at every position (the random
    # pico model and SmolLM2 have no near-ties on these prompts at float32)
    assert gen.tokens == _teacher_forced_argmax(folder, prompts, gen.tokens)
    assert gen.logprobs is not None and all(lp <= 0 for row in gen.logprobs for lp in row)
    assert kv.bytes_per_token == 2 * layers * kv_heads * head_dim * 4  # float32 cache
    assert kv.capacity_tokens * kv.bytes_per_token <= budget and kv.total_bytes <= budget


@pytest.mark.engines
def test_vllm_serves_a_gqakit_llama_output(tmp_path):
    _vllm_python()
    src = build("llama", tmp_path / "src", hidden_size=128, num_attention_heads=4, num_key_value_heads=4)
    out = convert(src, tmp_path / "g2", 2)
    _serve_and_compare(out, [[1, 5, 9, 13, 17], [1, 40, 3], [1, 7, 7, 7, 2, 11]], 8, kv_heads=2, layers=2,
                       head_dim=32, budget=1 << 20)


@pytest.mark.engines
def test_vllm_time_point(tmp_path):
    _vllm_python()
    eng = get_engine("vllm")
    eng.load(build("llama", tmp_path / "src", hidden_size=128, num_attention_heads=4, num_key_value_heads=2),
             EngineOptions(dtype="float32", max_len=64, kv_budget_bytes=1 << 20, max_batch=2))
    try:
        t = eng.time_point(2, 8, 3, reps=2, warmup=1)
    finally:
        eng.close()
    assert len(t.prefill_s) == 2 and len(t.decode_s) == 2 and all(x > 0 for x in t.prefill_s)


@pytest.mark.engines
def test_eval_speed_on_vllm_end_to_end(tmp_path, capsys):
    """`gqakit eval OUT --speed --engine vllm` on a converted pico Llama: every point ran on vLLM
    and records vLLM's KV allocation, at the bytes per token gqakit predicts (vLLM gets a KV budget
    sized for the grid, not its default share of the machine's memory)."""
    from gqakit.cli import main

    _vllm_python()
    src = build("llama", tmp_path / "src", hidden_size=256, num_attention_heads=4, num_key_value_heads=4)
    out = convert(src, tmp_path / "g2", 2)
    try:
        main([str(a) for a in ["eval", out, "--speed", "--engine", "vllm", "--batch", "1,2", "--prompt-len", "16",
                               "--new-tokens", "4", "--reps", "2", "--out", tmp_path / "s.json", "-q"]])
    except SystemExit as e:
        assert not e.code, capsys.readouterr().err
    speed = json.loads((tmp_path / "s.json").read_text())["speed"]
    assert [g["status"] for g in speed["grid"]] == ["ok", "ok"] and {g["engine"] for g in speed["grid"]} == {"vllm"}
    # 2 x 2 layers x 2 KV heads x head_dim 64 x 4 bytes: vLLM's allocation is the geometry's prediction
    assert speed["settings"]["engine_kv"]["bytes_per_token"] == speed["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4


@pytest.mark.engines
@pytest.mark.assets
@pytest.mark.slow
def test_vllm_serves_smollm2_at_one_kv_head(tmp_path):
    _vllm_python()
    gguf = Path("~/.cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
    if not gguf.is_file():
        pytest.skip(f"{gguf} not found (run `gqakit demo` once)")
    out = convert(gguf, tmp_path / "g1", 1)
    prompts = [[1, 504, 3585, 282, 253], [1, 11, 1326, 314, 10112, 30, 378], [1, 2683, 1345], [1, 48, 18, 7, 22]]
    _serve_and_compare(out, prompts, 16, kv_heads=1, layers=30, head_dim=64, budget=64 << 20)
