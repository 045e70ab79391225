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
from gqakit.engines import llamacpp as llamacpp_engine
from gqakit.engines.llamacpp_kv import gguf_geometry, predicted_bytes_per_token, read_kv_state, row_bytes

gguf = pytest.importorskip("gguf")
from test_convert_gguf import write_gguf  # noqa: E402
from test_convert_gguf import SMOLLM2  # noqa: E402
from test_hostile import run_cli  # noqa: E402
from tolerance import rounding_tolerance  # noqa: E402


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
    assert llama_kwargs(p, EngineOptions(), "F32")["type_k"] == llama_kwargs(p, EngineOptions(), "F32")["type_v"] == 0
    assert "type_k" not in llama_kwargs(p, EngineOptions(), "F16")  # llama.cpp's default
    with pytest.raises(GqakitError, match="KV-cache type 'Q2_K'"):
        llama_kwargs(p, EngineOptions(), "Q2_K")


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
    with pytest.raises(GqakitError, match="no engine named 'llama'; engines: .*llama.cpp"):
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
    """One sequence's KV state as llama_state_seq_get_data writes it: the magic number and the
    sequence id (llama-context.cpp), then llama_kv_cache::state_write (llama-kv-cache.cpp):
    n_stream, cell_count, per cell pos / n_seq_id / [ext] / seq ids, then v_trans, n_layer, per
    layer K type + row size + rows, per layer V type + row size + rows (transposed: type,
    element size, row width, then the elements)."""
    b = struct.pack("<IiII", 0xAF143CD8, 0, 1, cells)
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


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (bash scripts/engines.sh llama.cpp)")


def teacher_forced(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' log-probs at each position where the engine chose a token."""
    with torch.no_grad():
        return model(torch.tensor([prompt + generated])).logits[0].double().log_softmax(-1)[len(prompt) - 1:-1]


@pytest.mark.engines
def test_a_pico_gguf_written_by_gqakit_serves_in_llama_cpp_as_in_transformers(llama_cpp, tiny_model, tmp_path):
    """The source GGUF (4 KV heads) and gqakit's 4 -> 2 conversion of it: llama.cpp's greedy
    tokens and log-probs are transformers' on the same file, and its KV cache holds
    2 x layers x KV heads x head_dim values per token, 2 bytes each (F16, its default) or 4 (F32)."""
    src = pico_gguf(tiny_model, tmp_path / "src.gguf", kv=4)
    out = convert_gguf(src, tmp_path / "g2.gguf", 2, progress=False)
    prompts = [[1, 5, 9, 13, 20], [1, 40, 41], [1, *range(10, 40)]]
    config = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="src.gguf").config
    head_dim = config.hidden_size // config.num_attention_heads
    for path, kv in ((src, 4), (out, 2)):
        for kv_type, size in (("F16", 2), ("F32", 4)):
            engine = LlamaCppEngine(kv_type)
            engine.load(path, EngineOptions(max_len=64, threads=1))
            gen = engine.generate(prompts, 12)
            alloc = engine.kv_allocation()
            again = engine.generate(prompts[:1], 12)  # the cache is cleared between calls
            timing = engine.time_point(1, 16, 3, reps=2, warmup=1)
            engine.close()
            assert again.tokens[0] == gen.tokens[0]
            assert len(timing.prefill_s) == 2 and len(timing.decode_s) == 6 and min(timing.decode_s) > 0
            assert alloc.bytes_per_token == 2 * config.num_hidden_layers * kv * head_dim * size
            assert alloc.detail["type_k"] == alloc.detail["type_v"] == [kv_type]
            assert alloc.detail["predicted_bytes_per_token"] == alloc.bytes_per_token
            assert alloc.capacity_tokens == 256 and alloc.total_bytes == 256 * alloc.bytes_per_token  # 64 -> 256
        # With an F32 cache, llama.cpp and transformers compute the same F32 function in their own
        # orders: per layer the score and value sums, the output projection and the MLP, then
        # the LM head, on logits of magnitude up to the largest one.
        model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()
        path_length = config.num_hidden_layers * (head_dim + 64 + 2 * config.hidden_size + 2 * config.intermediate_size)
        for prompt, got, lps in zip(prompts, gen.tokens, gen.logprobs):
            lp = teacher_forced(model, prompt, got)
            tol = rounding_tolerance(torch.float32, path_length + config.hidden_size, float(lp.abs().max()))
            ref = lp[torch.arange(len(got)), torch.tensor(got)]
            torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), ref, rtol=0, atol=tol)
            gaps = lp.max(-1).values - ref
            assert all(int(lp[i].argmax()) == t or gaps[i] < tol for i, t in enumerate(got)), (got, gaps)


@pytest.mark.engines
def test_eval_check_and_speed_run_on_a_gguf(llama_cpp, tiny_model, tmp_path, capfd):
    """`gqakit eval X.gguf --engine llama.cpp --check` and `--speed` end to end on gqakit's 4 -> 2
    GGUF: the check passes with the KV prediction at llama.cpp's own F16 cache (not the teacher's
    float32), and the speed points carry the engine and its KV allocation."""
    import json

    src = pico_gguf(tiny_model, tmp_path / "src.gguf", kv=4)
    out = convert_gguf(src, tmp_path / "g2.gguf", 2, progress=False)
    code, stdout, err = run_cli(["eval", out, "--engine", "llama.cpp", "--check", "--out", tmp_path / "c.json"], capfd)
    block = json.loads((tmp_path / "c.json").read_text())["serving"]
    assert code == 0, stdout + err
    assert block["passed"] and block["kv"]["cache_dtype"] == "F16" and block["kv"]["match"]
    code, stdout, err = run_cli(["eval", out, "--engine", "llama.cpp", "--speed", "--batch", "1", "--prompt-len", "16",
                                 "--new-tokens", "4", "--reps", "2", "--out", tmp_path / "s.json"], capfd)
    assert code == 0, stdout + err
    speed = json.loads((tmp_path / "s.json").read_text())["speed"]
    assert speed["grid"] and all(g["status"] == "ok" and g["engine"] == "llama.cpp" for g in speed["grid"])
    assert all(g["engine_kv"]["bytes_per_token"] == block["kv"]["allocated_bytes_per_token"] for g in speed["grid"])
    # the bytes a step reads are the GGUF's own tensors and llama.cpp's F16 cache, not the
    # float32 model transformers dequantises
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(out).tensors}
    emb = tensors["token_embd.weight"]
    rows = int(next(t for t in gguf.GGUFReader(out).tensors if t.name == "token_embd.weight").shape[-1])
    weights = sum(tensors.values()) - ((emb - emb // rows) if "output.weight" in tensors else 0)
    assert speed["kv_bytes_per_token"] == block["kv"]["allocated_bytes_per_token"]
    assert all(g["bytes_per_step"]["weights"] == weights for g in speed["grid"])


@pytest.mark.engines
@pytest.mark.assets
def test_smollm2_at_one_kv_head_allocates_a_third(llama_cpp, tmp_path):
    """SmolLM2-135M Q4_1 (3 KV heads) and `gqakit convert ... -g 1`: llama.cpp's KV cache per
    token is 2 x 30 layers x KV heads x 64 x 2 bytes (23,040 and 7,680: a third), and the
    original's greedy tokens are transformers' on the same file but for near-ties."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} not found (run `gqakit demo` once)")
    out = convert_gguf(SMOLLM2, tmp_path / "g1.gguf", 1, "mean", progress=False)
    prompt = [1, 504, 3458, 282, 253, 1345, 28, 314, 2468, 30, 378]
    got = {}
    for path in (SMOLLM2, out):
        engine = get_engine("llama.cpp")
        engine.load(path, EngineOptions(max_len=64, threads=1))
        got[path] = engine.generate([prompt], 8), engine.kv_allocation()
        engine.close()
    assert got[SMOLLM2][1].bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert got[out][1].bytes_per_token == 2 * 30 * 1 * 64 * 2
    assert got[out][1].capacity_tokens == got[SMOLLM2][1].capacity_tokens == 256
    gen = got[SMOLLM2][0]
    model = AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name).eval()
    lp = teacher_forced(model, prompt, gen.tokens[0])
    chosen = lp[torch.arange(8), torch.tensor(gen.tokens[0])]
    # llama.cpp multiplies Q4_1 weights by activations it rounds to 8 bits per 32-value block
    # (Q8_1), transformers by float32 ones: 0.5 nat covers that here (measured up to 0.25, see
    # docs/benchmarks.md, "Serving check"); a wrong head or position costs nats.
    assert float((lp.max(-1).values - chosen).max()) < 0.5
    assert float((torch.tensor(gen.logprobs[0], dtype=torch.float64) - chosen).abs().max()) < 0.5


@pytest.mark.engines
def test_llama_cpps_log_stays_off_stderr_and_a_failed_load_names_its_reason(llama_cpp, tiny_model, tmp_path, capfd):
    """A context longer than the model's training context (128 positions) makes llama.cpp log a
    warning; the engine keeps llama.cpp's log off stderr (so `-q` is quiet) and puts its last
    line into the one-line error of a load that fails."""
    src = pico_gguf(tiny_model, tmp_path / "src.gguf", kv=4)
    capfd.readouterr()
    engine = LlamaCppEngine()
    engine.load(src, EngineOptions(max_len=512, threads=1))
    engine.generate([[1, 5, 9]], 2)
    engine.close()
    out, err = capfd.readouterr()
    assert err == "" and out == ""
    assert any("n_ctx_train" in line for _, line in llamacpp_engine.LOG)  # the warning was logged, not printed
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 60)  # the magic, then a version llama.cpp does not know
    with pytest.raises(GqakitError, match=r"could not load .*bad\.gguf: .* \(llama\.cpp: gguf_init.+\)$"):
        LlamaCppEngine().load(bad, EngineOptions(max_len=64, threads=1))
    assert capfd.readouterr().err == ""
