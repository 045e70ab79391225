"""Pico models built in code, one per family of the architecture table, saved as HF folders.

Nothing is downloaded: each model is `XxxConfig(...)` + random init + `save_pretrained`,
with a tiny byte-level tokenizer so the folders are complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

HIDDEN, LAYERS, VOCAB = 32, 2, 64


def _configs() -> dict[str, Any]:
    from transformers import (Gemma2Config, GemmaConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig,
                              OlmoConfig, OPTConfig, Phi3Config, PhiConfig, Qwen2Config, Qwen3Config, StableLmConfig)

    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    common = dict(vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=False, **ids)
    return {
        "llama": lambda **o: LlamaConfig(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                            "num_hidden_layers": LAYERS, "num_attention_heads": 8,
                                            "num_key_value_heads": 8, **o}),
        "mistral": lambda **o: MistralConfig(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                                "num_hidden_layers": LAYERS, "num_attention_heads": 8,
                                                "num_key_value_heads": 8, "sliding_window": None, **o}),
        "qwen2": lambda **o: Qwen2Config(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                            "num_hidden_layers": LAYERS, "num_attention_heads": 8,
                                            "num_key_value_heads": 8, **o}),
        # gemma: head_dim (16) != hidden / heads (4)
        "gemma": lambda **o: GemmaConfig(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                            "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                                            "num_key_value_heads": 4, "head_dim": 16, **o}),
        # gemma2: sliding-window layers alternate with global ones (a window shorter than the
        # calibration sequences, so each layer type gets its own mask)
        "gemma2": lambda **o: Gemma2Config(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                              "num_hidden_layers": LAYERS, "num_attention_heads": 8,
                                              "num_key_value_heads": 8, "head_dim": 8, "sliding_window": 16, **o}),
        # phi3: fused qkv_proj rows [q | k | v] (not transposed)
        "phi3": lambda **o: Phi3Config(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                          "num_hidden_layers": LAYERS, "num_attention_heads": 8,
                                          "num_key_value_heads": 8, **o}),
        "olmo": lambda **o: OlmoConfig(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                          "num_hidden_layers": LAYERS, "num_attention_heads": 8,
                                          "num_key_value_heads": 8, **o}),
        # qwen3: per-head q/k norms
        "qwen3": lambda **o: Qwen3Config(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                            "num_hidden_layers": LAYERS, "num_attention_heads": 8,
                                            "num_key_value_heads": 8, "head_dim": 8, **o}),
        # stablelm: partial rotary
        "stablelm": lambda **o: StableLmConfig(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                                  "num_hidden_layers": LAYERS, "num_attention_heads": 8,
                                                  "num_key_value_heads": 8, "partial_rotary_factor": 0.5, **o}),
        # phi: partial rotary, biases everywhere
        "phi": lambda **o: PhiConfig(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                        "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                                        "num_key_value_heads": 4, "partial_rotary_factor": 0.5, **o}),
        "gpt2": lambda **o: GPT2Config(**{**ids, "vocab_size": VOCAB, "n_positions": 128, "n_embd": HIDDEN,
                                          "n_layer": LAYERS, "n_head": 4, **o}),
        # gpt_neox: fused, per-head interleaved qkv, partial rotary
        "gpt_neox": lambda **o: GPTNeoXConfig(**{**ids, "vocab_size": VOCAB, "max_position_embeddings": 128,
                                                 "hidden_size": HIDDEN, "intermediate_size": 64,
                                                 "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                                                 "rotary_pct": 0.5, **o}),
        "opt": lambda **o: OPTConfig(**{**ids, "vocab_size": VOCAB, "max_position_embeddings": 128,
                                        "hidden_size": HIDDEN, "ffn_dim": 64, "num_hidden_layers": LAYERS,
                                        "num_attention_heads": 4, "word_embed_proj_dim": HIDDEN,
                                        "enable_bias": True, **o}),
    }


def families() -> list[str]:
    """Every family of the architecture table (core/architectures/*.json), which the tests
    run over; `tests/test_architectures.py` checks `_configs` has a pico model for each."""
    from gqakit.core.arch import supported

    return supported()


FAMILIES = families()


def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges and a 64-symbol vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    alphabet = [chr(i) for i in range(33, 33 + VOCAB - 3)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def build(family: str, folder: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """Save a randomly initialised pico model of `family` (and a tokenizer) to `folder`."""
    from transformers import AutoModelForCausalLM

    cfg = _configs()[family](**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # Randomise everything (biases and norms too), so no test passes by zeros or ones.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return Path(folder)


@pytest.fixture
def tiny_model(tmp_path: Path):
    """Factory: tiny_model("llama", num_key_value_heads=4) -> folder of a saved pico model."""
    counter = iter(range(1000))

    def make(family: str, **overrides) -> Path:
        return build(family, tmp_path / f"{family}-{next(counter)}", **overrides)

    return make
