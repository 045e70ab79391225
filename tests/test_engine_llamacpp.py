"""The llama.cpp engine (engines/llamacpp.py).

Without llama_cpp (the default suite): which file is loaded and how a model folder without a
GGUF is refused (the command it names is run and writes the same model), the arguments given
to llama_cpp.Llama, the refusals, the one-line error when llama-cpp-python is missing, and the
KV-cache byte arithmetic: llama.cpp's state layout parsed from bytes written here the way
llama-kv-cache.cpp writes them, and the prediction from a GGUF's geometry.

With llama_cpp (`engines` marker, skipped without it): a pico GGUF that gqakit wrote, served
by llama.cpp: greedy tokens as transformers' on the same file, KV bytes per token as predicted.
"""

from __future__ import annotations

import shlex
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gqakit.convert import convert_checkpoint, convert_gguf
from gqakit.core.errors import GqakitError
from gqakit.engines import get_engine
from gqakit.engines.base import EngineMissing, EngineOptions
from gqakit.engines.llamacpp import LlamaCppEngine, llama_kwargs, resolve_gguf
from gqakit.engines.llamacpp_kv import gguf_geometry, predicted_bytes_per_token, read_kv_state, row_bytes

gguf = pytest.importorskip("gguf")
from test_convert_gguf import write_gguf  # noqa: E402
from test_hostile import run_cli  # noqa: E402


def pico_gguf(tiny_model, path: Path, kv: int = 4) -> Path:
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama", num_key_value_heads=kv)).eval()
    return write_gguf(model, path)


# ----------------------------------------------------------------------------- which file


def test_resolve_a_file_a_folder_and_a_named_file(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"GGUF")
    assert resolve_gguf(one / "m.gguf", None) == one / "m.gguf"
    assert resolve_gguf(one, None) == one / "m.gguf"
    (one / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(GqakitError, match="2 .gguf files .*gguf_file"):
        resolve_gguf(one, None)
    assert resolve_gguf(one, "n.gguf") == one / "n.gguf"
    assert resolve_gguf(tmp_path, str(one / "n.gguf")) == one / "n.gguf"
    with pytest.raises(GqakitError, match="GGUF file not found"):
        resolve_gguf(one, "x.gguf")
    (one / "w.safetensors").write_bytes(b"")
    with pytest.raises(GqakitError, match="not one"):
        resolve_gguf(one / "w.safetensors", None)
    with pytest.raises(GqakitError, match="model not found"):
        resolve_gguf(tmp_path / "nowhere", None)


def test_a_folder_output_is_refused_with_the_command_that_writes_its_gguf(tiny_model, tmp_path, monkeypatch, capfd):
    """GGUF -> folder at G = H (a dequantised copy) -> folder at G = 2: the refusal names the
    GGUF conversion from the original file, and that command writes the same model."""
    src = pico_gguf(tiny_model, tmp_path / "src.gguf")
    same = convert_checkpoint(src, tmp_path / "same", 4, progress=False)
    g2 = convert_checkpoint(same, tmp_path / "g2", 2, progress=False)
    with pytest.raises(GqakitError) as e:
        LlamaCppEngine().load(g2, EngineOptions())
    msg = str(e.value)
    assert "\n" not in msg and "model folder without one" in msg
    command = msg.split("`")[1]
    assert command == f"gqakit convert {src} g2.gguf -g 2 --method align --grouping contiguous", msg
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(shlex.split(command)[1:] + ["-q"], capfd)
    assert code == 0, err
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="g2.gguf").eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(g2).eval()(ids).logits
    # the same F32 values in the same modules: nothing rounds differently
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_folder_from_a_folder_source_names_llama_cpps_converter(tiny_model, tmp_path):
    out = convert_checkpoint(tiny_model("llama", num_key_value_heads=4), tmp_path / "g2", 2, progress=False)
    with pytest.raises(GqakitError, match=r"GGUF source only .*convert_hf_to_gguf.py"):
        resolve_gguf(out, None)


# ----------------------------------------------------------------------------- arguments, refusals


def test_llama_arguments(tmp_path):
    p = tmp_path / "m.gguf"
    kw = llama_kwargs(p, EngineOptions(max_len=4096, threads=1))
    assert kw == {"model_path": str(p), "n_ctx": 4096, "n_batch": 512, "logits_all": False, "verbose": False,
                  "n_threads": 1, "n_threads_batch": 1}
    assert llama_kwargs(p, EngineOptions(max_len=100))["n_batch"] == 100
    assert "n_threads" not in llama_kwargs(p, EngineOptions())
    with pytest.raises(GqakitError, match="GGUF's own tensor types"):
        llama_kwargs(p, EngineOptions(dtype="float16"))
    with pytest.raises(GqakitError, match="context length"):
        llama_kwargs(p, EngineOptions(kv_budget_bytes=2**30))


def test_not_installed_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    with pytest.raises(EngineMissing) as e:
        get_engine("llama.cpp").load(tmp_path / "m.gguf", EngineOptions())
    assert "\n" not in str(e.value) and "scripts/engines.sh llama.cpp" in str(e.value)
    assert "gqakit[llamacpp]" in str(e.value)


def test_importing_the_registry_imports_no_engine():
    code = "import sys, gqakit.engines; print(sorted(m for m in ('llama_cpp', 'torch', 'vllm') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
    with pytest.raises(GqakitError, match="unknown engine 'llama'; choose one of .*llama.cpp"):
        get_engine("llama")


def test_an_encoder_decoder_gguf_is_refused_and_closed(tmp_path, monkeypatch):
    """A fake llama_cpp whose model has an encoder (a T5 GGUF): refused in one line, the
    model freed; the fake also records the arguments the engine passes."""
    seen: dict = {}

    class Llama:
        def __init__(self, **kw):
            seen["kw"], self.model = kw, object()

        def close(self):
            seen["closed"] = True

    fake = types.SimpleNamespace(Llama=Llama, llama_model_has_encoder=lambda m: True)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    (tmp_path / "t5.gguf").write_bytes(b"GGUF")
    with pytest.raises(GqakitError, match="encoder-decoder GGUF"):
        LlamaCppEngine().load(tmp_path / "t5.gguf", EngineOptions(max_len=64, threads=2))
    assert seen["closed"] and seen["kw"]["n_ctx"] == 64 and seen["kw"]["n_threads"] == 2


def test_batches_above_one_and_unloaded_engines_are_refused():
    e = LlamaCppEngine()
    with pytest.raises(GqakitError, match="one sequence per context: batch must be 1"):
        e.time_point(4, 16, 4, 1, 0)
    with pytest.raises(GqakitError, match="no model loaded"):
        e.generate([[1, 2]], 2)


# ----------------------------------------------------------------------------- KV bytes


def kv_state(cells: int, k_rows: list[int], v_rows: list[int], *, v_trans: bool, ext: int = 0,
             k_type: int = 1, v_type: int = 1) -> bytes:
    """One sequence's KV state as llama_kv_cache::state_write lays it out (llama-kv-cache.cpp):
    n_stream, cell_count, per cell pos / n_seq_id / [ext] / seq ids, then v_trans, n_layer, per
    layer K type + row size + rows, per layer V type + row size + rows (transposed: type,
    element size, row width, then the elements)."""
    b = struct.pack("<II", 1, cells)
    for pos in range(cells):
        b += struct.pack("<iI", pos, 1) + bytes(ext) + struct.pack("<i", 0)
    b += struct.pack("<II", int(v_trans), len(k_rows))
    for r in k_rows:
        b += struct.pack("<iQ", k_type, r) + bytes(cells * r)
    for r in v_rows:
        b += struct.pack("<iII", v_type, 2, r // 2) if v_trans else struct.pack("<iQ", v_type, r)
        b += bytes(cells * r)
    return b


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("ext", [0, 8])
def test_kv_state_is_read_as_llama_cpp_writes_it(v_trans, ext):
    k, v = [768, 768, 256], [768, 768, 256]  # a layer with fewer KV heads reads as such
    got = read_kv_state(kv_state(5, k, v, v_trans=v_trans, ext=ext), 3)
    assert got.cells == 5 and got.k_rows == tuple(k) and got.v_rows == tuple(v) and got.v_trans == v_trans
    assert got.bytes_per_token == 2 * (768 + 768 + 256) and got.k_types == ("F16",) * 3
    q8 = read_kv_state(kv_state(2, [68], [68], v_trans=False, k_type=8, v_type=8), 1)
    assert q8.k_types == ("Q8_0",) and q8.bytes_per_token == 136


def test_a_kv_state_of_another_layout_is_one_line():
    with pytest.raises(GqakitError, match="not in the layout"):
        read_kv_state(kv_state(3, [64, 64], [64, 64], v_trans=False), 3)  # the model has 3 layers, the state 2
    with pytest.raises(GqakitError, match="not in the layout"):
        read_kv_state(b"\x00" * 40, 1)


def test_predicted_kv_bytes():
    smollm2 = {"general.architecture": "llama", "llama.block_count": "30", "llama.attention.head_count": "9",
               "llama.attention.head_count_kv": "3", "llama.embedding_length": "576"}
    g = gguf_geometry(smollm2)
    assert g == {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim_k": 64, "head_dim_v": 64}
    assert predicted_bytes_per_token(g) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert predicted_bytes_per_token(g | {"kv_heads": 1}) == 23_040 // 3
    assert predicted_bytes_per_token(g, "F32", "F32") == 2 * predicted_bytes_per_token(g)
    assert row_bytes("Q8_0", 64) == 2 * 34  # two blocks of 32: 32 int8 + an f16 scale
    assert gguf_geometry({k: v for k, v in smollm2.items() if "_kv" not in k})["kv_heads"] == 9
    with pytest.raises(GqakitError, match="Q8_0 blocks"):
        row_bytes("Q8_0", 48)


# ----------------------------------------------------------------------------- llama.cpp itself
