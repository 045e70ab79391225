"""GGUF input: a tiny llama written as GGUF (llama.cpp's q/k permutation included)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gqakit.convert import convert_checkpoint
from gqakit.convert.gguf_in import GGUFSource
from gqakit.convert.io import DictSource
from gqakit.convert.source import open_model

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import quantize  # noqa: E402


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (undone by transformers on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_OF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def gguf_layer_names(arch: str, model) -> dict[str, str]:
    """GGUF name -> transformers name of one layer's tensors (layer 0 as `{i}`): the table above
    for llama and qwen2, gguf-py's tensor-name table for any other architecture."""
    if arch in ("llama", "qwen2"):
        return {g: hf for g, hf in HF_OF.items()}
    key = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(key, 1)
    out = {}
    for name in model.state_dict():
        if name.startswith("model.layers.0.") and name.endswith(".weight"):
            hf = name[len("model.layers.0."):-len(".weight")]
            g = table.get_name(f"model.layers.0.{hf}")
            if g is not None:
                out[g[len("blk.0."):]] = hf
    return out


def write_gguf(model, path: Path, arch: str = "llama", qtype: QT = QT.F32) -> Path:
    """A pico HF model as a GGUF file the way llama.cpp's converter lays it out: 2-D weights
    in QTYPE, 1-D tensors in F32, q/k rows permuted for the llama architecture."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]))
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    if getattr(c, "head_dim", None) and c.head_dim != c.hidden_size // c.num_attention_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    tokens = ["<unk>", "<s>", "</s>"] + [chr(i) for i in range(33, 33 + c.vocab_size - 3)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_string("general.name", "pico")
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    t = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:  # llama.cpp writes no output.weight for a tied LM head
        t["output.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for g, hf in gguf_layer_names(arch, model).items():
            t[f"blk.{i}.{g}.weight"] = sd[f"{p}{hf}.weight"]
            if f"{p}{hf}.bias" in sd:
                t[f"blk.{i}.{g}.bias"] = sd[f"{p}{hf}.bias"]
        if arch == "llama":
            t[f"blk.{i}.attn_q.weight"] = _permute(t[f"blk.{i}.attn_q.weight"], c.num_attention_heads)
            t[f"blk.{i}.attn_k.weight"] = _permute(t[f"blk.{i}.attn_k.weight"], c.num_key_value_heads)
    for k, v in t.items():
        v = np.ascontiguousarray(v, dtype=np.float32)
        if v.ndim == 2 and qtype != QT.F32:
            w.add_tensor(k, quantize(v, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_input_converts_exactly(tiny_model, tmp_path):
    src = tiny_model("llama", num_key_value_heads=4)
    model = AutoModelForCausalLM.from_pretrained(src).eval()
    path = write_gguf(model, tmp_path / "tiny.gguf")
    ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    same = AutoModelForCausalLM.from_pretrained(convert_checkpoint(path, tmp_path / "g4", 4, progress=False))
    torch.testing.assert_close(same(ids).logits, ref, rtol=1e-5, atol=1e-5)
    out = convert_checkpoint(path, tmp_path / "g1", 1, progress=False)  # OUT beside the .gguf is fine
    g1 = AutoModelForCausalLM.from_pretrained(out)
    assert g1(ids, use_cache=True).past_key_values.layers[0].keys.shape[1] == 1
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("A") == tokens_id("A")
    assert path.is_file()  # source untouched
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    g1.save_pretrained(tmp_path / "resaved")  # a dequantized model must stay serializable


def tokens_id(tok: str) -> int:
    return 3 + ord(tok) - 33


# ----------------------------------------------------------------------------- streamed, equal to transformers

def transformers_tensors(path: Path) -> dict[str, torch.Tensor]:
    """transformers' own dequantisation of the GGUF file PATH (the whole model, float32)."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def transformers_folder(path: Path, dest: Path) -> Path:
    """transformers' dequantisation of the GGUF file PATH saved as a model folder (its
    save_pretrained refuses a GGUF-loaded model: the tensors and the config are saved here)."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.config.quantization_config = None
    del model.config.quantization_config
    model.config.save_pretrained(dest)
    save_file({k: v.contiguous() for k, v in transformers_tensors(path).items()}, dest / "model.safetensors",
              metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(dest)
    return dest


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(got[n].view(torch.uint8), t.contiguous().view(torch.uint8)), n


ARCHS = [("llama", QT.F16, {}), ("llama", QT.Q8_0, {}), ("qwen2", QT.Q8_0, {}),
         # read through transformers' own name map: qwen3 (q/k norms; transformers' GGUF config reads no head
    # size for it and takes 128), gemma2 (its processor shifts norms)
         ("qwen3", QT.Q8_0, {"head_dim": 128}), ("gemma2", QT.F16, {"tie_word_embeddings": True})]


@pytest.mark.parametrize("arch, qtype, extra", ARCHS, ids=[f"{a}-{q.name}" for a, q, _ in ARCHS])
def test_folder_output_is_transformers_dequantisation_streamed(tiny_model, tmp_path, arch, qtype, extra):
    """Every tensor of the folder output equals transformers' own dequantisation of the same
    GGUF, bit for bit, though the file is read tensor by tensor (a GGUFSource), not loaded whole."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model(arch, num_key_value_heads=4, **extra)).eval()
    path = write_gguf(model, tmp_path / "m.gguf", arch, qtype)
    assert isinstance(open_model(path, progress=False).source, GGUFSource)
    want = transformers_tensors(path)
    # G = KV heads: mean pooling changes nothing, so every output tensor is a dequantised source tensor
    same = convert_checkpoint(path, tmp_path / "g4", 4, method="mean", progress=False)
    assert_bitwise_equal(folder_tensors(same), want)
    # G < KV heads: the same conversion as from transformers' model saved as a folder
    hf = transformers_folder(path, tmp_path / "hf")
    a = convert_checkpoint(path, tmp_path / "g2", 2, method="align", progress=False)
    b = convert_checkpoint(hf, tmp_path / "g2-ref", 2, method="align", progress=False)
    assert_bitwise_equal(folder_tensors(a), folder_tensors(b))


def test_without_a_name_map_transformers_loads_the_whole_model_and_says_so(tiny_model, tmp_path, monkeypatch,
                                                                            capfd):
    """An architecture with no map that streams falls back to transformers' whole-model load,
    in one line with the memory it takes, and writes the same folder."""
    from gqakit.convert import gguf_in

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama", num_key_value_heads=4)).eval()
    path = write_gguf(model, tmp_path / "m.gguf", "llama", QT.Q8_0)
    streamed = convert_checkpoint(path, tmp_path / "streamed", 2, method="mean", progress=False)
    # llama read through transformers' map and its LlamaTensorProcessor (q/k un-permuted there)
    monkeypatch.setattr(gguf_in, "GGUF_ARCHS", {})
    via_transformers = convert_checkpoint(path, tmp_path / "via-transformers", 2, method="mean", progress=False)
    assert_bitwise_equal(folder_tensors(via_transformers), folder_tensors(streamed))
    # no processor that reads tensor by tensor: the whole model is loaded
    monkeypatch.setattr(gguf_in, "PER_TENSOR_PROCESSORS", frozenset())
    assert isinstance(open_model(path, progress=False).source, DictSource)
    capfd.readouterr()
    whole = convert_checkpoint(path, tmp_path / "whole", 2, method="mean", progress=True)
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if "whole model" in x)
    assert "m.gguf" in line and "LlamaTensorProcessor" in line and "GiB" in line
    assert_bitwise_equal(folder_tensors(whole), folder_tensors(streamed))


def test_align_refit_from_gguf_loads_blocks_from_the_mapped_file(tiny_model, tmp_path):
    """align-refit from a GGUF source gives the folder that it gives from transformers'
    dequantised model saved as a folder (its blocks come from the memory-mapped reader)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama", num_key_value_heads=4)).eval()
    path = write_gguf(model, tmp_path / "m.gguf", "llama", QT.Q8_0)
    hf = transformers_folder(path, tmp_path / "hf")
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(chr(33 + (i * 7) % 61) for i in range(3000)))
    kw = dict(calibration_data=str(calib), calibration_tokens=512, options={"seq_len": 32}, device="cpu",
              progress=False)
    a = folder_tensors(convert_checkpoint(path, tmp_path / "a", 2, "align-refit", **kw))
    b = folder_tensors(convert_checkpoint(hf, tmp_path / "b", 2, "align-refit", **kw))
    assert set(a) == set(b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6)


SMOLLM2 = Path.home() / ".cache/gqakit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mean", "align"])
def test_smollm2_q4_1_folder_is_transformers_whole_model_load(tmp_path, method):
    """SmolLM2-135M's real Q4_1 GGUF, streamed, writes the folder that transformers'
    whole-model dequantisation writes: the same files, tensor for tensor bit for bit."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} not found (run `gqakit demo` once)")
    from gqakit.convert import gguf_in

    streamed = convert_checkpoint(SMOLLM2, tmp_path / "streamed", 1, method=method, progress=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_in, "GGUF_ARCHS", {})
        mp.setattr(gguf_in, "PER_TENSOR_PROCESSORS", frozenset())
        whole = convert_checkpoint(SMOLLM2, tmp_path / "whole", 1, method=method, progress=False)
    for f in sorted(p.name for p in whole.iterdir()):
        if f == "gqakit_convert.json":  # holds the seconds
            a, b = (json.loads((d / f).read_text()) for d in (streamed, whole))
            a.pop("seconds"), b.pop("seconds")
            assert a == b
        else:
            assert (streamed / f).read_bytes() == (whole / f).read_bytes(), f
