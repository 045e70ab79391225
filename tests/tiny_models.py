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
        # gptj: separate q/k/v without biases, rotate-every-two on the first rotary_dim (4 of 8) dims
        "gptj": lambda **o: _transformers().GPTJConfig(**{**ids, "vocab_size": VOCAB, "n_positions": 128,
                                                          "n_embd": HIDDEN, "n_layer": LAYERS, "n_head": 4,
                                                          "rotary_dim": 4, "tie_word_embeddings": False, **o}),
        # codegen: fused qkv_proj in 4 blocks of [q | v | k] (2 heads each), rotate-every-two on 2 of 4 dims
        "codegen": lambda **o: _transformers().CodeGenConfig(**{**ids, "vocab_size": VOCAB, "n_positions": 128,
                                                                "n_ctx": 128, "n_embd": HIDDEN, "n_layer": LAYERS,
                                                                "n_head": 8, "rotary_dim": 2,
                                                                "tie_word_embeddings": False, **o}),
        # bloom: ALiBi (no rotary), per-head interleaved fused qkv with biases
        "bloom": lambda **o: __import__("transformers").BloomConfig(**{**ids, "vocab_size": VOCAB,
                                                                       "hidden_size": HIDDEN, "n_layer": LAYERS,
                                                                       "n_head": 4, "seq_length": 128, **o}),
        # mpt: ALiBi (no rotary), fused Wqkv [q | k | v] without biases
        "mpt": lambda **o: __import__("transformers").MptConfig(**{**ids, "vocab_size": VOCAB, "d_model": HIDDEN,
                                                                   "n_layers": LAYERS, "n_heads": 4,
                                                                   "max_seq_len": 128, "expansion_ratio": 2, **o}),
        # olmo2: q/k RMSNorms over the whole projection, norms after attention and MLP
        "olmo2": lambda **o: _transformers().Olmo2Config(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64,
                                                            "num_hidden_layers": LAYERS, "num_attention_heads": 8,
                                                            "num_key_value_heads": 8, **o}),
        # decilm: nemotron-nas layout (gqakit's per-layer output), layer i with kv_heads[i] KV heads
        "decilm": lambda **o: _decilm_config(common, **o),
        # falcon: Falcon-RW's layout (per-head [q, k, v] rows, ALiBi, sequential attention and
        # MLP, biases); falcon_new_decoder below is the new decoder architecture
        "falcon": lambda **o: _transformers().FalconConfig(**{**common, "hidden_size": HIDDEN,
                                                              "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                                                              "multi_query": False, "alibi": True,
                                                              "parallel_attn": False, "bias": True, **o}),
    }


def _decilm_config(common: dict[str, Any], kv_heads: tuple[int, ...] | None = None, **o: Any) -> Any:
    """A nemotron-nas config (gqakit's modeling file, registered with the Auto classes here so
    that `from_config` builds it): per layer `kv_heads` of 8 query heads (default: every layer
    `num_key_value_heads`, 8)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gqakit.convert.remote.gqakit_modeling_decilm import DeciLMConfig, DeciLMForCausalLM

    AutoConfig.register(DeciLMConfig.model_type, DeciLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(DeciLMConfig, DeciLMForCausalLM, exist_ok=True)
    layers = o.pop("num_hidden_layers", LAYERS)
    kv = kv_heads or (o.pop("num_key_value_heads", 8),) * layers
    blocks = [{"attention": {"n_heads_in_group": 8 // g, "no_op": False, "replace_with_linear": False},
               "ffn": {"intermediate_size": 64, "no_op": False, "replace_with_linear": False}} for g in kv]
    mod = "gqakit_modeling_decilm"
    return DeciLMConfig(**{**common, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": layers,
                           "num_attention_heads": 8, "block_configs": blocks, "architectures": ["DeciLMForCausalLM"],
                           "auto_map": {"AutoConfig": f"{mod}.DeciLMConfig",
                                        "AutoModelForCausalLM": f"{mod}.DeciLMForCausalLM"}, **o})


def _transformers() -> Any:
    import transformers

    return transformers


def families(*, encoder_decoder: bool = False) -> list[str]:
    """The decoder-only families of the architecture table (core/architectures/*.json), which
    the family-wide decoder tests run over, or (`encoder_decoder`) its encoder-decoders;
    `tests/test_architectures.py` checks there is a pico model for each."""
    from gqakit.core.arch import registry

    return sorted(f for f, spec in registry().items() if spec.is_encoder_decoder == encoder_decoder)


FAMILIES = families()
SEQ2SEQ_FAMILIES = families(encoder_decoder=True)


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

    return _save_random(AutoModelForCausalLM, _configs()[family](**overrides), tiny_tokenizer(), folder, seed, dtype)


def _save_random(auto: Any, cfg: Any, tokenizer: Any, folder: Path, seed: int, dtype: torch.dtype) -> Path:
    torch.manual_seed(seed)
    model = auto.from_config(cfg, dtype=dtype)
    remote = getattr(cfg, "auto_map", None)  # a gqakit modeling file: it goes beside the weights
    if remote:
        import importlib
        import shutil

        module = importlib.import_module(f"gqakit.convert.remote.{remote['AutoConfig'].split('.')[0]}")
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copy2(module.__file__, Path(folder) / Path(module.__file__).name)
    # Randomise everything (biases and norms too), so no test passes by zeros or ones.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


@pytest.fixture
def tiny_model(tmp_path: Path):
    """Factory: tiny_model("llama", num_key_value_heads=4) -> folder of a saved pico model."""
    counter = iter(range(1000))

    def make(family: str, **overrides) -> Path:
        return build(family, tmp_path / f"{family}-{next(counter)}", **overrides)

    return make


# ----------------------------------------------------------------------------- encoder-decoders

SEQ2SEQ_VOCAB, SENTINELS = 64, 16


def _seq2seq_configs() -> dict[str, Any]:
    from transformers import (BartConfig, M2M100Config, MarianConfig, MBartConfig, MT5Config, PegasusConfig, T5Config,
                              WhisperConfig)

    t5 = dict(vocab_size=SEQ2SEQ_VOCAB, d_model=HIDDEN, d_ff=64, num_layers=LAYERS, num_decoder_layers=LAYERS,
              num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0)
    bart_like = dict(vocab_size=SEQ2SEQ_VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     max_position_embeddings=128, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                     decoder_start_token_id=2, forced_eos_token_id=2, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    return {
        # T5 1.0: ReLU MLP, head tied to the embedding (T5 then scales the decoder output by d_model**-0.5)
        "t5": lambda **o: T5Config(**{**t5, "d_kv": 8, "feed_forward_proj": "relu", "tie_word_embeddings": True, **o}),
        # T5 1.1 / Flan-T5: gated GELU, untied head; heads * d_kv (48) != d_model (32), as in t5-11b
        "t5_v1_1": lambda **o: T5Config(**{**t5, "d_kv": 12, "feed_forward_proj": "gated-gelu",
                                           "tie_word_embeddings": False, **o}),
        "mt5": lambda **o: MT5Config(**{**t5, "d_kv": 8, "feed_forward_proj": "gated-gelu",
                                        "tie_word_embeddings": False, **o}),
        # BART: learned positions, biases, scaled queries
        "bart": lambda **o: BartConfig(**{"vocab_size": SEQ2SEQ_VOCAB, "d_model": HIDDEN, "encoder_layers": LAYERS,
                                          "decoder_layers": LAYERS, "encoder_attention_heads": 4,
                                          "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
                                          "decoder_ffn_dim": 64, "max_position_embeddings": 128,
                                          "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2,
                                          "decoder_start_token_id": 2, "forced_eos_token_id": 2,
                                          "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
                                          **o}),
        # Pegasus: pre-layer-norm, sinusoidal positions, scaled embeddings
        "pegasus": lambda **o: PegasusConfig(**{**bart_like, "scale_embedding": True, **o}),
        # mBART: pre-layer-norm, learned positions, scaled embeddings
        "mbart": lambda **o: MBartConfig(**{**bart_like, "scale_embedding": True, **o}),
        # M2M100 / NLLB: pre-layer-norm, sinusoidal positions counted past the padding, scaled embeddings
        "m2m100": lambda **o: M2M100Config(**{**bart_like, "scale_embedding": True, **o}),
        # Marian: post-layer-norm, sinusoidal positions, scaled embeddings, one shared vocabulary
        "marian": lambda **o: MarianConfig(**{**bart_like, "scale_embedding": True, "decoder_start_token_id": 1,
                                              **o}),
        # Whisper: log-mel features in (WHISPER_FRAMES frames of WHISPER_MELS bins, halved by the conv
        # front end), k_proj without bias, queries scaled before the product
        "whisper": lambda **o: WhisperConfig(**{"vocab_size": SEQ2SEQ_VOCAB, "num_mel_bins": WHISPER_MELS,
                                                "d_model": HIDDEN, "encoder_layers": LAYERS,
                                                "decoder_layers": LAYERS, "encoder_attention_heads": 4,
                                                "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
                                                "decoder_ffn_dim": 64, "max_source_positions": WHISPER_FRAMES // 2,
                                                "max_target_positions": 64, "bos_token_id": 0,
                                                "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0,
                                                "begin_suppress_tokens": None, "suppress_tokens": None,
                                                "dropout": 0.0, "attention_dropout": 0.0,
                                                "activation_dropout": 0.0, **o}),
    }


WHISPER_MELS, WHISPER_FRAMES = 8, 24  # the pico Whisper's input features: [batch, mels, frames]
SEQ2SEQ_KINDS = ("t5", "t5_v1_1", "mt5", "bart")  # t5_v1_1 is the `t5` family in its 1.1 layout
SEQ2SEQ_FAMILY = {"t5": "t5", "t5_v1_1": "t5", "mt5": "mt5", "bart": "bart"}  # kind -> table family
SEQ2SEQ_KINDS += ("pegasus", "mbart", "m2m100", "marian", "whisper")
SEQ2SEQ_FAMILY.update({"pegasus": "pegasus", "mbart": "mbart", "m2m100": "m2m100", "marian": "marian",
                       "whisper": "whisper"})
# Kinds with BART's attention (biases on every projection) and its tokenizer (<s> <pad> </s> <unk>, no sentinels)
BART_LIKE = ("bart", "pegasus", "mbart", "m2m100", "marian")
AUDIO_KINDS = ("whisper",)  # input_features in, not input_ids: tests/test_family_whisper.py covers them
TEXT_SEQ2SEQ_KINDS = tuple(k for k in SEQ2SEQ_KINDS if k not in AUDIO_KINDS)


def seq2seq_tokenizer(kind: str) -> Any:
    """A character-level tokenizer of `SEQ2SEQ_VOCAB` symbols: lower-case letters, digits and
    punctuation; T5-style kinds also have `SENTINELS` sentinel tokens <extra_id_0>... at the
    top of the vocabulary (extra_id_0 is the last id, as in T5)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = list("abcdefghijklmnopqrstuvwxyz0123456789 .,!?'-:;")
    if kind in (*BART_LIKE, "whisper"):
        special = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        symbols = alphabet + [chr(c) for c in range(0x41, 0x41 + SEQ2SEQ_VOCAB - len(special) - len(alphabet))]
        sentinels: list[str] = []
    else:
        special = {"<pad>": 0, "</s>": 1, "<unk>": 2}
        sentinels = [f"<extra_id_{i}>" for i in range(SENTINELS)]
        symbols = alphabet + [chr(c) for c in range(0x41, 0x41 + SEQ2SEQ_VOCAB - len(special) - len(alphabet)
                                                      - SENTINELS)]
    vocab = {**special, **{c: i + len(special) for i, c in enumerate(symbols)}}
    for i, s in enumerate(sentinels):
        vocab[s] = SEQ2SEQ_VOCAB - 1 - i
    assert len(vocab) == SEQ2SEQ_VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    names = dict(unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    if kind in (*BART_LIKE, "whisper"):
        names["bos_token"] = "<s>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, **names, additional_special_tokens=sentinels or None)


def build_seq2seq(kind: str, folder: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                  **overrides: Any) -> Path:
    """Save a randomly initialised pico encoder-decoder of `kind` (one of SEQ2SEQ_KINDS) and
    its tokenizer to `folder`."""
    return _save_random(seq2seq_auto(kind), _seq2seq_configs()[kind](**overrides), seq2seq_tokenizer(kind),
                        folder, seed, dtype)


def seq2seq_auto(kind: str) -> Any:
    """The transformers Auto class of a stock pico encoder-decoder: speech-to-text for the
    audio kinds (AUDIO_KINDS), else AutoModelForSeq2SeqLM."""
    from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    return AutoModelForSpeechSeq2Seq if kind in AUDIO_KINDS else AutoModelForSeq2SeqLM
