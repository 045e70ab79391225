"""GQA modeling files for text-input encoder-decoders (convert/remote/gqakit_modeling_t5.py; _bart.py,
which also holds the BART-like families; the audio-input ones in tests/test_family_<name>.py).

The GQA checkpoints are built here by hand from the stock pico models: each group of H/G
neighbouring K/V heads is mean-pooled into one head (decoder self- and cross-attention, and
the encoder when it is grouped too). The reference for a GQA model is independent of the
GQA code: the stock multi-head class with the pooled heads repeated G -> H.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import BART_LIKE, TEXT_SEQ2SEQ_KINDS, build_seq2seq
from transformers import AutoConfig, AutoModelForSeq2SeqLM

import gqakit.convert.remote as remote
from gqakit.convert.remote import gqakit_modeling_bart, gqakit_modeling_t5
from gqakit.core.trust import code_files, only_gqakit_code
from gqakit.core.trust import is_shipped

H = 4  # query heads of every stack of the pico encoder-decoders
REMOTE_DIR = Path(remote.__file__).resolve().parent
# kind -> (modeling file, config class, model class, model_type)
REMOTE = {
    "t5": ("gqakit_modeling_t5", "GqakitT5Config", "GqakitT5ForConditionalGeneration", "gqakit_t5"),
    "mt5": ("gqakit_modeling_t5", "GqakitMT5Config", "GqakitMT5ForConditionalGeneration", "gqakit_mt5"),
    "bart": ("gqakit_modeling_bart", "GqakitBartConfig", "GqakitBartForConditionalGeneration", "gqakit_bart"),
    "pegasus": ("gqakit_modeling_bart", "GqakitPegasusConfig", "GqakitPegasusForConditionalGeneration",
                "gqakit_pegasus"),
    "mbart": ("gqakit_modeling_bart", "GqakitMBartConfig", "GqakitMBartForConditionalGeneration", "gqakit_mbart"),
    "m2m100": ("gqakit_modeling_bart", "GqakitM2M100Config", "GqakitM2M100ForConditionalGeneration",
               "gqakit_m2m100"),
    "marian": ("gqakit_modeling_bart", "GqakitMarianConfig", "GqakitMarianMTModel", "gqakit_marian"),
}
REMOTE["t5_v1_1"] = REMOTE["t5"]
MODULES = {"gqakit_modeling_t5": gqakit_modeling_t5, "gqakit_modeling_bart": gqakit_modeling_bart}
# K / V projections (T5 and mT5: no bias; BART: weight and bias), of any stack
KV = re.compile(r"\.(SelfAttention|EncDecAttention)\.[kv]\.weight$"
                r"|\.(self_attn|encoder_attn)\.[kv]_proj\.(weight|bias)$")
ENCODER = re.compile(r"^(model\.)?encoder\.")
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


# --- checkpoints, built by hand ----------------------------------------------------------------

def pool(t: torch.Tensor, g: int) -> torch.Tensor:
    """Rows of H heads -> rows of G heads, each the mean of its group of H/G neighbouring heads."""
    return t.view(g, H // g, -1, *t.shape[1:]).mean(1).flatten(0, 1)


def repeat(t: torch.Tensor, g: int) -> torch.Tensor:
    """Rows of G heads -> rows of H heads, each head repeated H/G times in place."""
    return t.view(g, -1, *t.shape[1:]).repeat_interleave(H // g, dim=0).flatten(0, 1)


def remote_config(kind: str, g: int, encoder_g: int) -> dict[str, Any]:
    """The keys a converter adds to the stock config.json of an encoder-decoder."""
    module, config_class, model_class, model_type = REMOTE[kind]
    return {"model_type": model_type, "architectures": [model_class],
            "auto_map": {"AutoConfig": f"{module}.{config_class}",
                         "AutoModelForSeq2SeqLM": f"{module}.{model_class}"},
            "num_key_value_heads": g, "encoder_num_key_value_heads": encoder_g}


def write_folder(src: Path, out: Path, kind: str, g: int, encoder_g: int, *, as_stock: bool = False) -> Path:
    """SRC's weights with K/V pooled to G heads (encoder: ENCODER_G). AS_STOCK: the pooled heads
    repeated back to H, in a stock folder (the multi-head reference); else the GQA folder."""
    out.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    for key in [k for k in sd if KV.search(k)]:
        n = encoder_g if ENCODER.match(key) else g
        sd[key] = repeat(pool(sd[key], n), n) if as_stock else pool(sd[key], n).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if not as_stock:
        cfg.update(remote_config(kind, g, encoder_g))
        module = REMOTE[kind][0]
        shutil.copy(REMOTE_DIR / f"{module}.py", out / f"{module}.py")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def load(folder: Path, attn: str = "sdpa", **kw: Any) -> Any:
    model, info = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn,
                                                        output_loading_info=True, **kw)
    # A missing or mismatched key would be silently random-initialised: every weight must load.
    assert not any(info.values()), info
    return model.eval()


@pytest.fixture
def stock(tmp_path: Path) -> Any:
    def make(kind: str) -> Path:
        return build_seq2seq(kind, tmp_path / f"stock_{kind}")
    return make


def inputs(padded: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (2, 9), generator=gen)
    mask = torch.ones_like(ids)
    if padded:  # with a mask, sdpa repeats K/V (or packs the query heads); without one it runs enable_gqa
        mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def logits(model: Any, enc: dict[str, torch.Tensor]) -> torch.Tensor:
    dec = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(**enc, decoder_input_ids=dec).logits


def generate(model: Any, enc: dict[str, torch.Tensor], **kw: Any) -> Any:
    with torch.no_grad():
        return model.generate(**enc, **GEN, **kw)


# --- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("module", sorted(MODULES))
def test_files_are_self_contained_and_shipped(module: str) -> None:
    path = REMOTE_DIR / f"{module}.py"
    tree = ast.parse(path.read_text())
    imported = {n.name for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names}
    imported |= {"." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    # loaded by stock transformers without gqakit installed
    assert {m.split(".")[0] for m in imported} <= {"__future__", "typing", "torch", "transformers"}, imported
    assert is_shipped(path)  # gqakit's loaders trust it by its sha256


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_same_heads_is_stock(kind: str, attn: str, stock: Any, tmp_path: Path) -> None:
    src = stock(kind)
    gqa = load(write_folder(src, tmp_path / "gqa", kind, H, H), attn, trust_remote_code=True)
    ref = load(src, attn)
    assert type(gqa).__name__ == REMOTE[kind][2] and gqa.config.model_type == REMOTE[kind][3]
    for enc in (inputs(True), inputs(False)):
        torch.testing.assert_close(logits(gqa, enc), logits(ref, enc), rtol=0, atol=0)
        torch.testing.assert_close(generate(gqa, enc), generate(ref, enc), rtol=0, atol=0)


@pytest.mark.parametrize("g", [2, 1])
@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_grouped_caches_hold_g_heads(kind: str, g: int, stock: Any, tmp_path: Path) -> None:
    src = stock(kind)
    gqa = load(write_folder(src, tmp_path / "gqa", kind, g, g), trust_remote_code=True)
    ref = load(src)
    d_head = ref.config.d_kv if hasattr(ref.config, "d_kv") else ref.config.d_model // H
    kv_rows = {k: v.shape[0] for k, v in gqa.state_dict().items() if KV.search(k)}
    assert kv_rows and set(kv_rows.values()) == {g * d_head}  # every stack, every K and V
    assert logits(gqa, inputs()).shape == logits(ref, inputs()).shape

    out = generate(gqa, inputs(), return_dict_in_generate=True)
    assert out.sequences.shape == (2, 1 + GEN["max_new_tokens"])
    cache = out.cache
    n_layers = len(gqa.get_decoder().block if hasattr(gqa.get_decoder(), "block") else gqa.get_decoder().layers)
    assert len(cache.self_attention_cache.layers) == len(cache.cross_attention_cache.layers) == n_layers
    for self_layer, cross_layer in zip(cache.self_attention_cache.layers, cache.cross_attention_cache.layers):
        for t in (self_layer.keys, self_layer.values):
            assert t.shape[:2] == (2, g) and t.shape[-1] == d_head
        for t in (cross_layer.keys, cross_layer.values):
            assert t.shape == (2, g, inputs()["input_ids"].shape[1], d_head)
    # without a cache, and with transformers' static cache (sized from num_key_value_heads): the same tokens
    for kw in ({"use_cache": False}, {"cache_implementation": "static"}):
        torch.testing.assert_close(generate(gqa, inputs(), **kw), out.sequences, rtol=0, atol=0)


@pytest.mark.parametrize(("g", "encoder_g"), [(2, H), (2, 2), (1, 1)])
@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_grouped_equals_stock_with_repeated_heads(kind: str, g: int, encoder_g: int, stock: Any,
                                                  tmp_path: Path) -> None:
    src = stock(kind)
    folder = write_folder(src, tmp_path / "gqa", kind, g, encoder_g)
    reference = write_folder(src, tmp_path / "ref", kind, g, encoder_g, as_stock=True)
    tight = dict(rtol=1e-5, atol=1e-5)
    by_attn = {}
    for attn in ("eager", "sdpa"):
        gqa, ref = load(folder, attn, trust_remote_code=True), load(reference, attn)
        # padded and unpadded take different sdpa paths; eager runs the same code on both
        for enc in (inputs(True), inputs(False)):
            torch.testing.assert_close(logits(gqa, enc), logits(ref, enc), **tight)
            torch.testing.assert_close(generate(gqa, enc), generate(ref, enc), rtol=0, atol=0)
        by_attn[attn] = logits(gqa, inputs())
    torch.testing.assert_close(by_attn["eager"], by_attn["sdpa"], **tight)


@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_train_mode_and_gradient_checkpointing(kind: str, stock: Any, tmp_path: Path) -> None:
    folder = write_folder(stock(kind), tmp_path / "gqa", kind, 2, 2)
    batch = {**inputs(), "labels": torch.randint(3, 40, (2, 5), generator=torch.Generator().manual_seed(3))}
    results = []
    for checkpointing in (False, True):
        model = load(folder, "sdpa", trust_remote_code=True)
        if checkpointing:
            model.activation_checkpointing_enable()
        model.train()
        loss = model(**batch).loss
        loss.backward()
        grads = {k: p.grad for k, p in model.named_parameters() if KV.search(k)}
        assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
        results.append((loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    for key in grads_a:
        torch.testing.assert_close(grads_a[key], grads_b[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_save_pretrained_roundtrip(kind: str, stock: Any, tmp_path: Path) -> None:
    module, config_class, model_class, _ = REMOTE[kind]
    expected = remote_config(kind, 2, 1)
    folder = write_folder(stock(kind), tmp_path / "gqa", kind, 2, 1)
    gqa = load(folder, trust_remote_code=True)
    # a model built directly from the classes of the shipped file saves the same folder
    direct = getattr(MODULES[module], model_class)(getattr(MODULES[module], config_class).from_pretrained(folder))
    direct.load_state_dict(gqa.state_dict())
    for name, model in (("saved", gqa), ("direct", direct)):
        model.save_pretrained(tmp_path / name)
        saved = tmp_path / name
        assert (saved / f"{module}.py").read_bytes() == (REMOTE_DIR / f"{module}.py").read_bytes()
        written = json.loads((saved / "config.json").read_text())
        for key, value in expected.items():
            assert written[key] == value, key
        assert only_gqakit_code(code_files(saved))  # gqakit's loaders run it without --trust-remote-code
        again = load(saved, "sdpa", trust_remote_code=True)
        torch.testing.assert_close(logits(again, inputs()), logits(gqa, inputs()), rtol=0, atol=0)


@pytest.mark.parametrize("kind", TEXT_SEQ2SEQ_KINDS)
def test_stock_loading_without_remote_code_refuses(kind: str, stock: Any, tmp_path: Path) -> None:
    folder = write_folder(stock(kind), tmp_path / "gqa", kind, 2, 2)
    with pytest.raises(Exception, match="trust_remote_code"):
        AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=False)


@pytest.mark.parametrize("kind", ["t5", "mt5", *BART_LIKE])
@pytest.mark.parametrize("key", ["num_key_value_heads", "encoder_num_key_value_heads"])
def test_kv_heads_that_do_not_divide_are_refused(kind: str, key: str, stock: Any, tmp_path: Path) -> None:
    module, config_class, _, _ = REMOTE[kind]
    cls = getattr(MODULES[module], config_class)
    heads = {"num_heads": H} if kind not in BART_LIKE else {"encoder_attention_heads": H, "decoder_attention_heads": H}
    assert getattr(cls(**heads), key) == H  # absent: one KV head per query head
    assert getattr(cls(**heads, **{key: 2}), key) == 2
    for bad in (3, 0, 8):
        with pytest.raises(ValueError, match=f"{key} \\({bad}\\) must be a positive divisor of the number of "
                                             f"attention heads \\({H}\\)"):
            cls(**heads, **{key: bad})
    # a folder whose config.json says so is refused the same way
    folder = write_folder(stock(kind), tmp_path / "gqa", kind, 2, 2)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, key: 3}))
    with pytest.raises(ValueError, match=f"{key} \\(3\\) must be a positive divisor"):
        AutoConfig.from_pretrained(folder, trust_remote_code=True)


def test_bart_heads_of_each_stack() -> None:
    """BART's stacks may have different head counts: each KV key is checked against its own stack."""
    cls = gqakit_modeling_bart.GqakitBartConfig
    cfg = cls(encoder_attention_heads=8, decoder_attention_heads=4, num_key_value_heads=2,
              encoder_num_key_value_heads=8)
    assert (cfg.num_key_value_heads, cfg.encoder_num_key_value_heads) == (2, 8)
    with pytest.raises(ValueError, match="num_key_value_heads \\(8\\)"):
        cls(encoder_attention_heads=8, decoder_attention_heads=4, num_key_value_heads=8)
