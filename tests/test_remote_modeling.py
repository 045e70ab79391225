"""GQA modeling files for gpt2 / gpt_neox / opt (gqakit.convert.remote).

The GQA weight layouts are built here by hand from docs/design.md, independently of the
converter, so these tests pin the layouts and not just self-consistency:
- G = H reproduces the stock model exactly;
- for G < H, a stock model whose K/V heads are already identical within each group of H/G
  neighbouring heads is exactly representable with G heads, so logits must match stock.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from gqakit.convert.remote import modeling_file, remote_config_updates
from gqakit.core.arch import registry
from gqakit.core.trust import code_files, only_gqakit_code

# the decoder families whose table entry names a gqakit modeling file
REMOTE = [f for f, spec in registry().items() if spec.remote is not None and not spec.is_encoder_decoder]
# those whose GQA layouts this file builds by hand (each other family's own test file covers it)
FAMILIES = ["gpt2", "gpt_neox", "opt", "bloom", "mpt", "falcon"]
H = 4  # heads of the pico models in tests/tiny_models.py
# families whose fused query_key_value rows are (H, 3, D) in the stock model: its name per layer
NEOX_ROWS = {"gpt_neox": "gpt_neox.layers.{layer}.attention.query_key_value",
             "bloom": "transformer.h.{layer}.self_attention.query_key_value",
             "falcon": "transformer.h.{layer}.self_attention.query_key_value"}
EAGER_ONLY = {"bloom", "mpt"}  # stock transformers has only eager attention for these


# --- per-family views of one layer's K and V heads, and the GQA layouts (by hand) ----------

def _kv_head_views(family: str, sd: dict[str, torch.Tensor], layer: int) -> list[torch.Tensor]:
    """Views of the stock K and V weights/biases of `layer` with the head index first."""
    if family == "gpt2":
        w, b = sd[f"transformer.h.{layer}.attn.c_attn.weight"], sd[f"transformer.h.{layer}.attn.c_attn.bias"]
        hid = w.shape[0]
        # Conv1D weight [hidden, 3*hidden]: columns [q | k | v], each H heads of D.
        wv = w.view(hid, 3, H, hid // H).permute(1, 2, 0, 3)  # (3, H, hidden, D)
        bv = b.view(3, H, hid // H)
        return [wv[1], wv[2], bv[1], bv[2]]
    if family in NEOX_ROWS:
        p = NEOX_ROWS[family].format(layer=layer)
        w, b = sd[f"{p}.weight"], sd[f"{p}.bias"]
        hid = w.shape[1]
        # Linear weight [3*hidden, hidden]: rows (H, 3, D), per head q, k, v.
        wv, bv = w.view(H, 3, hid // H, hid), b.view(H, 3, hid // H)
        return [wv[:, 1], wv[:, 2], bv[:, 1], bv[:, 2]]
    if family == "mpt":
        w = sd[f"transformer.blocks.{layer}.attn.Wqkv.weight"]
        hid = w.shape[1]
        # Linear weight [3*hidden, hidden]: rows [q | k | v], each H heads of D; no biases.
        wv = w.view(3, H, hid // H, hid)
        return [wv[1], wv[2]]
    p = f"model.decoder.layers.{layer}.self_attn"
    out: list[torch.Tensor] = []
    for name in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
        t = sd[f"{p}.{name}"]
        out.append(t.view(H, -1, *t.shape[1:]))
    return out


def _num_layers(sd: dict[str, torch.Tensor]) -> int:
    return 1 + max(int(m.group(1)) for k in sd if (m := re.search(r"\.(?:h|layers|blocks)\.(\d+)\.", k)))


def tie_kv_within_groups(family: str, sd: dict[str, torch.Tensor], g: int) -> None:
    """In place: every K/V head (weights and biases) becomes a copy of its group's first head."""
    n_rep = H // g
    for layer in range(_num_layers(sd)):
        for view in _kv_head_views(family, sd, layer):
            for head in range(H):
                view[head] = view[head - head % n_rep]


def gqa_state_dict(family: str, sd: dict[str, torch.Tensor], g: int) -> dict[str, torch.Tensor]:
    """The GQA checkpoint for G = g: one K/V head per group (its first head), layouts of docs/design.md."""
    n_rep = H // g
    out = {k: v.clone() for k, v in sd.items()}
    for layer in range(_num_layers(sd)):
        if family == "gpt2":
            p = f"transformer.h.{layer}.attn.c_attn"
            w, b = sd[f"{p}.weight"], sd[f"{p}.bias"]
            hid = w.shape[0]
            q, k, v = w.split(hid, dim=1)
            qb, kb, vb = b.split(hid)

            def pick(t: torch.Tensor) -> torch.Tensor:  # last dim H*D -> G*D, each group's first head
                return t.view(*t.shape[:-1], H, hid // H)[..., ::n_rep, :].flatten(-2)

            out[f"{p}.weight"] = torch.cat([q, pick(k), pick(v)], dim=1).contiguous()  # [q | k | v]
            out[f"{p}.bias"] = torch.cat([qb, pick(kb), pick(vb)]).contiguous()
        elif family in NEOX_ROWS:
            p = NEOX_ROWS[family].format(layer=layer)
            for name in ("weight", "bias"):
                t = sd[f"{p}.{name}"]
                d = t.shape[0] // (3 * H)
                per_head = t.view(H, 3, d, *t.shape[1:])
                # rows (G, n_rep + 2, D): the group's n_rep query heads, then its K, then its V head
                q = per_head[:, 0].reshape(g, n_rep, d, *t.shape[1:])
                k, v = per_head[::n_rep, 1:2], per_head[::n_rep, 2:3]
                out[f"{p}.{name}"] = torch.cat([q, k, v], dim=1).reshape(-1, *t.shape[1:]).contiguous()
        elif family == "mpt":
            p = f"transformer.blocks.{layer}.attn.Wqkv.weight"
            hid = sd[p].shape[1]
            q, k, v = sd[p].view(3, H, hid // H, hid)
            out[p] = torch.cat([q, k[::n_rep], v[::n_rep]]).reshape(-1, hid).contiguous()  # [q | k | v]
        else:
            p = f"model.decoder.layers.{layer}.self_attn"
            for name in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
                t = sd[f"{p}.{name}"]
                out[f"{p}.{name}"] = t.view(H, -1, *t.shape[1:])[::n_rep].flatten(0, 1).contiguous()
    return out


def write_gqa_folder(src: Path, out: Path, family: str, g: int) -> Path:
    """What the converter writes: GQA weights + config updates + the modeling file."""
    out.mkdir()
    sd = load_file(str(src / "model.safetensors"))
    save_file(gqa_state_dict(family, sd, g), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(remote_config_updates(family, g))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(modeling_file(family), out / modeling_file(family).name)
    return out


# --- fixtures / helpers ---------------------------------------------------------------------

def _inputs(padded: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        # Left padding: SDPA gets a mask, so transformers repeats K/V (prefill) or packs the
        # query heads (decode). Unpadded, the mask is None and SDPA runs with enable_gqa=True.
        mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _logits(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**inputs).logits
    return logits[inputs["attention_mask"].bool()]  # padded positions carry no meaning


def _load(folder: Path, attn: str = "sdpa", **kw: Any) -> Any:
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn,
                                                       output_loading_info=True, **kw)
    # A missing or mismatched key would be silently random-initialised: every weight must load.
    assert not any(info.values()), info
    return model.eval()


@pytest.fixture
def tied_stock(tiny_model: Callable[..., Path]) -> Callable[..., Path]:
    """Factory: a stock folder whose K/V heads are identical within groups of H/g heads."""
    def make(family: str, g: int, **overrides: Any) -> Path:
        src = tiny_model(family, **overrides)
        sd = load_file(str(src / "model.safetensors"))
        tie_kv_within_groups(family, sd, g)
        save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
        return src
    return make


# --- tests ----------------------------------------------------------------------------------

def test_api() -> None:
    assert set(FAMILIES) <= set(REMOTE)
    for family in REMOTE:
        upd = remote_config_updates(family, 2)
        assert upd["model_type"] == f"gqakit_{family}" and upd["num_key_value_heads"] == 2
        module, cls = upd["auto_map"]["AutoModelForCausalLM"].split(".")
        assert module == modeling_file(family).stem and upd["architectures"] == [cls]
        # the file may import only torch and transformers: it is loaded without gqakit installed
        tree = ast.parse(modeling_file(family).read_text())
        imported = {n.name for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names}
        imported |= {"." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert {m.split(".")[0] for m in imported} <= {"__future__", "typing", "torch", "transformers"}, imported


@pytest.mark.parametrize("family", FAMILIES)
def test_g_equals_h_is_stock(family: str, tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_model(family)
    folder = write_gqa_folder(src, tmp_path / "gqa", family, H)
    assert only_gqakit_code(code_files(folder))
    inputs = _inputs()
    for attn in ("eager",) if family in EAGER_ONLY else ("eager", "sdpa"):
        gqa = _load(folder, attn, trust_remote_code=True)
        assert type(gqa).__name__ == registry()[family].remote.model_class
        torch.testing.assert_close(_logits(gqa, inputs), _logits(_load(src, attn), inputs))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("g", [2, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_exact(family: str, g: int, attn: str, tied_stock: Callable[..., Path],
                       tmp_path: Path) -> None:
    if attn != "eager" and family in EAGER_ONLY:
        pytest.skip(f"{family} has only eager attention")
    src = tied_stock(family, g)
    folder = write_gqa_folder(src, tmp_path / "gqa", family, g)
    gqa = _load(folder, attn, trust_remote_code=True)
    stock = _load(src, attn)
    # Unpadded inputs only change the code path for SDPA (enable_gqa), not for eager.
    input_sets = [_inputs(True), _inputs(False)] if attn == "sdpa" else [_inputs(True)]
    for inputs in input_sets:
        torch.testing.assert_close(_logits(gqa, inputs), _logits(stock, inputs))

    # The cache holds G heads per layer: the memory saving that is the point of GQA.
    with torch.no_grad():
        cache = gqa(**_inputs(), use_cache=True).past_key_values
    assert len(cache.layers) == 2
    for layer in cache.layers:
        assert layer.keys.shape[1] == g and layer.values.shape[1] == g

    # Greedy decoding (prefill + single-token steps, with and without a padding mask) equals stock.
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for inputs in input_sets:
            torch.testing.assert_close(gqa.generate(**inputs, **gen), stock.generate(**inputs, **gen), rtol=0, atol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_attention_options(attn: str, tied_stock: Callable[..., Path], tmp_path: Path) -> None:
    """gpt2's per-layer scaling and (eager) reorder_and_upcast_attn are kept in the GQA model."""
    src = tied_stock("gpt2", 2, scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)
    folder = write_gqa_folder(src, tmp_path / "gqa", "gpt2", 2)
    torch.testing.assert_close(_logits(_load(folder, attn, trust_remote_code=True), _inputs()),
                               _logits(_load(src, attn), _inputs()))


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_roundtrip(family: str, tied_stock: Callable[..., Path], tmp_path: Path) -> None:
    folder = write_gqa_folder(tied_stock(family, 2), tmp_path / "gqa", family, 2)
    attn = "eager" if family in EAGER_ONLY else "sdpa"
    gqa = _load(folder, attn, trust_remote_code=True)
    # What uptrain does after training: save the remote-code model, which must stay loadable.
    gqa.save_pretrained(tmp_path / "saved")
    saved = tmp_path / "saved"
    assert (saved / modeling_file(family).name).read_text() == modeling_file(family).read_text()
    cfg = json.loads((saved / "config.json").read_text())
    for key in ("model_type", "num_key_value_heads", "auto_map", "architectures"):
        assert cfg[key] == remote_config_updates(family, 2)[key], key
    assert only_gqakit_code(code_files(saved))
    inputs = _inputs()
    torch.testing.assert_close(_logits(_load(saved, attn, trust_remote_code=True), inputs), _logits(gqa, inputs))


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_loading_without_remote_code_refuses(family: str, tiny_model: Callable[..., Path],
                                                    tmp_path: Path) -> None:
    folder = write_gqa_folder(tiny_model(family), tmp_path / "gqa", family, 2)
    with pytest.raises(Exception, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)


def test_neox_lm_head_names(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """Pythia checkpoints call the LM head `embed_out`; folders saved as `lm_head` load too."""
    src = tiny_model("gpt_neox")
    folder = write_gqa_folder(src, tmp_path / "gqa", "gpt_neox", 2)
    sd = load_file(str(folder / "model.safetensors"))
    assert "embed_out.weight" in sd  # stock save_pretrained name, kept by write_gqa_folder
    ref = _logits(_load(folder, trust_remote_code=True), _inputs())
    sd["lm_head.weight"] = sd.pop("embed_out.weight")
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    torch.testing.assert_close(_logits(_load(folder, trust_remote_code=True), _inputs()), ref)
