"""GGUF input: a tiny llama written as GGUF (llama.cpp's q/k permutation included)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gqakit.convert import convert_checkpoint

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import quantize  # noqa: E402


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (undone by transformers on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_OF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


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
    t = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
         "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for g, hf in HF_OF.items():
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
