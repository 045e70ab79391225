"""A per-layer plan into GGUF: llama.cpp's `deci` architecture with per-layer head counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gqakit.convert.pipeline import convert_gguf_file  # noqa: E402
from gqakit.convert.settings import ConvertSettings  # noqa: E402
from test_convert_gguf import _permute, write_gguf  # noqa: E402
from test_kv_plan import HEADS, LAYERS, PLAN, convert, load, plan_file  # noqa: E402

HEAD_DIM = 32 // HEADS


@pytest.fixture
def sources(tiny_model, tmp_path: Path) -> tuple[Path, Path]:
    """A pico Llama (4 layers, 8 KV heads) as a model folder and as the GGUF llama.cpp's converter writes."""
    src = tiny_model("llama", num_hidden_layers=LAYERS)
    return src, write_gguf(load(src), tmp_path / "src.gguf")


def to_gguf(src: Path, out: Path, plan: Path) -> Path:
    settings = ConvertSettings(source=str(src), kv_plan=plan, method="mean", grouping="contiguous",
                               max_shard_size=None)
    return convert_gguf_file(settings, out)


def test_per_layer_gguf_is_deci_with_head_count_arrays(sources, tmp_path):
    folder_src, gguf_src = sources
    out = to_gguf(gguf_src, tmp_path / "out.gguf", plan_file(tmp_path, PLAN))
    r = gguf.GGUFReader(out)
    fields = {name: f.contents() for name, f in r.fields.items()}
    assert fields["general.architecture"] == "deci"
    assert fields["deci.attention.head_count_kv"] == PLAN
    assert fields["deci.attention.head_count"] == [HEADS] * LAYERS
    assert fields["deci.block_count"] == LAYERS and not [k for k in fields if k.startswith("llama.")]
    assert fields["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]  # the rest is SRC's, as it was
    # each layer's K and V hold its own heads: the folder conversion's, with llama.cpp's q/k row order
    folder = load(convert(folder_src, tmp_path / "folder", kv_plan=plan_file(tmp_path, PLAN, "p2.json")))
    tensors = {t.name: t for t in r.tensors}
    for i, g in enumerate(PLAN):
        k, v = tensors[f"blk.{i}.attn_k.weight"], tensors[f"blk.{i}.attn_v.weight"]
        assert [int(x) for x in k.shape] == [32, g * HEAD_DIM] == [int(x) for x in v.shape]
        attn = folder.model.layers[i].self_attn
        np.testing.assert_array_equal(np.asarray(k.data), _permute(attn.k_proj.weight.detach().numpy(), g))
        np.testing.assert_array_equal(np.asarray(v.data), attn.v_proj.weight.detach().numpy())


def test_uniform_plan_keeps_the_source_architecture(sources, tmp_path):
    out = to_gguf(sources[1], tmp_path / "out.gguf", plan_file(tmp_path, [2] * LAYERS))
    fields = {name: f.contents() for name, f in gguf.GGUFReader(out).fields.items()}
    assert fields["general.architecture"] == "llama" and fields["llama.attention.head_count_kv"] == 2


@pytest.mark.engines
def test_llama_cpp_runs_the_deci_gguf_as_transformers_does(sources, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'gqakit[llama]')")
    folder_src, gguf_src = sources
    out = to_gguf(gguf_src, tmp_path / "out.gguf", plan_file(tmp_path, PLAN))
    folder = load(convert(folder_src, tmp_path / "folder", kv_plan=plan_file(tmp_path, PLAN, "p2.json")))
    ids = [1] + [int(i) for i in torch.randint(3, 64, (15,), generator=torch.Generator().manual_seed(1))]
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, n_threads=1, n_threads_batch=1, logits_all=True,
                          verbose=False)
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)])
    with torch.no_grad():
        want = folder(torch.tensor([ids])).logits[0].numpy()
    # llama.cpp computes in float32 with its own kernels and op order: the next token agrees, and
    # the logits agree far better than a wrong head or layer would (those move them by ~1e-1)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() < 1e-3 * max(1.0, float(np.abs(want).max()))


def test_per_layer_gguf_of_a_non_llama_layout_refused(tiny_model, tmp_path, capsys):
    from cli_helpers import assert_one_line_error, run_cli

    src = write_gguf(load(tiny_model("qwen2", num_hidden_layers=LAYERS)), tmp_path / "q.gguf", arch="qwen2")
    capsys.readouterr()
    code, _, err = run_cli(["convert", src, tmp_path / "out.gguf", "--kv-plan", plan_file(tmp_path, PLAN)], capsys)
    assert_one_line_error(code, err, "deci architecture", "the nearest uniform plan is -g 4")
    assert not (tmp_path / "out.gguf").exists()


# ----------------------------------------------------------------------------- the check's reference


def test_reference_of_a_deci_gguf_is_the_folder_conversion(sources, tmp_path, monkeypatch):
    """transformers cannot load a deci GGUF; gqakit's reference reads it: the same weights, the
    same per-layer config, hence the very logits of the folder converted with the same plan
    (same class, same values, same op order: equal to the bit). Its temporary folder is gone."""
    import tempfile

    from gqakit.core.loaded import loaded_shape
    from gqakit.core.loading import load_tokenizer
    from gqakit.engines.llamacpp_ref import per_layer_gguf, reference_model

    folder_src, gguf_src = sources
    out = to_gguf(gguf_src, tmp_path / "out.gguf", plan_file(tmp_path, PLAN))
    assert per_layer_gguf(out) and not per_layer_gguf(gguf_src)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    ref = reference_model(out)
    assert not list(scratch.iterdir())
    folder = load(convert(folder_src, tmp_path / "folder", kv_plan=plan_file(tmp_path, PLAN, "p2.json")))
    assert list(loaded_shape(ref.config).kv_heads_per_layer) == PLAN
    want = folder.state_dict()
    got = ref.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    rand = torch.randint(3, 64, (15,), generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1] + [int(i) for i in rand]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, folder(ids).logits)
    assert load_tokenizer(out).convert_ids_to_tokens([1, 2]) == ["<s>", "</s>"]


def test_reference_reads_quantised_k_rows_with_each_layers_heads(sources, tmp_path):
    """A Q8_0 deci GGUF: each reference tensor is gguf-py's dequantisation of the file's bytes,
    k un-permuted with its own layer's KV heads (a wrong head count scrambles its rows)."""
    from gguf.quants import dequantize

    from gqakit.engines.llamacpp_ref import reference_model

    settings = ConvertSettings(source=str(sources[1]), kv_plan=plan_file(tmp_path, PLAN), method="mean",
                               grouping="contiguous", max_shard_size=None)
    out = convert_gguf_file(settings, tmp_path / "q8.gguf", gguf_type="Q8_0")
    ref = reference_model(out)
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    for i, g in enumerate(PLAN):
        k = tensors[f"blk.{i}.attn_k.weight"]
        assert k.tensor_type == gguf.GGMLQuantizationType.Q8_0
        raw = dequantize(k.data, k.tensor_type).reshape(g * HEAD_DIM, 32)
        want = _unpermute(raw, g)
        np.testing.assert_array_equal(_permute(want, g), raw)
        np.testing.assert_array_equal(ref.model.layers[i].self_attn.k_proj.weight.detach().numpy(), want)
        if g > 1:  # another head count reads other rows
            assert not np.array_equal(_unpermute(raw, g // 2), want)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `_permute` (transformers' un-permutation of llama.cpp's q/k rows)."""
    d2 = w.shape[0] // n_head // 2
    return w.reshape(n_head, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.engines
def test_eval_check_passes_on_a_deci_gguf(sources, tmp_path, capfd):
    """`gqakit eval OUT.gguf --engine llama.cpp --check` on a deci GGUF (float32 weights): the
    reference is gqakit's reading of the file, the check passes, and llama.cpp's KV bytes per
    token are each layer's own heads at its F16 cache."""
    import json

    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'gqakit[llamacpp]')")
    from test_hostile import run_cli

    out = to_gguf(sources[1], tmp_path / "out.gguf", plan_file(tmp_path, PLAN))
    code, stdout, err = run_cli(["eval", out, "--engine", "llama.cpp", "--check", "--out", tmp_path / "c.json"], capfd)
    assert code == 0, stdout + err
    block = json.loads((tmp_path / "c.json").read_text())["serving"]
    assert block["passed"] and block["agreement"] == 1.0 and block["margin_row"] == "float16"
    assert block["kv"]["kv_heads_per_layer"] == PLAN
    assert block["kv"]["allocated_bytes_per_token"] == 2 * sum(PLAN) * HEAD_DIM * 2


def test_perplexity_of_a_deci_gguf_is_its_references(sources, tmp_path, capsys):
    """`gqakit eval OUT.gguf --data TEXT` on a deci GGUF: the tokenizer comes from the file's own
    vocabulary (transformers' AutoTokenizer has no deci config to look up) and the model is the
    reference read from the same file, so the perplexity equals that of the reference saved as a
    folder with that tokenizer (same weights, same tokens, same op order: equal to the bit)."""
    import json

    from cli_helpers import run_cli
    from gqakit.core.loading import load_tokenizer
    from gqakit.engines.llamacpp_ref import reference_model

    _, gguf_src = sources
    out = to_gguf(gguf_src, tmp_path / "out.gguf", plan_file(tmp_path, PLAN))
    tok = load_tokenizer(out)  # the file's vocabulary: <s> and </s> at 1 and 2, as the converter wrote them
    assert tok.convert_ids_to_tokens([1, 2]) == ["<s>", "</s>"]
    folder = tmp_path / "ref"
    reference_model(out).save_pretrained(folder)
    tok.save_pretrained(folder)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(tok.convert_ids_to_tokens(list(range(3, 60)))) * 4)
    ppl = {}
    for name, model in (("gguf", out), ("folder", folder)):
        code, _, err = run_cli(["eval", model, "--data", text, "--context", "16", "--out",
                                tmp_path / f"{name}.json", "-q"], capsys)
        assert code == 0, err
        ppl[name] = json.loads((tmp_path / f"{name}.json").read_text())["perplexity"]
    assert ppl["gguf"]["tokens"] == ppl["folder"]["tokens"] > 0
    assert ppl["gguf"]["token_perplexity"] == ppl["folder"]["token_perplexity"]
