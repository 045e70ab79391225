"""The family seam: everything gqakit knows about a model family lives in its architecture
table entry (`core/architectures/*.json`, validated by `core/arch.py`).

Product code never names a family: no family or model type of the table appears as a string
constant or an attribute name in any product module (docstrings and comments aside), so no
stage picks a family by `hasattr(model, "<family>")` or by comparing a name. What differs
between families is read from the entry: the fast decode step's layout (`decode`), the GGUF
architecture and its q/k row permutation (`gguf`), the blocks, attentions and config keys.
"""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

from gqakit.core import arch
from test_layering import product_modules

ROOT = Path(__file__).resolve().parents[1]

# (file, name): why that family name may appear there. Keep this short.
ALLOWED: dict[tuple[str, str], str] = {}

# Decode layouts are named after the family each was written for, and several families share
# one (core.arch.DecodeLayout). A layout name may appear where it is used as a layout: inside
# the `Literal[...]` that defines them, as a key of a dict keyed only by layouts (a per-layout
# dispatch table), compared with an entry's `.decode`, or as a module constant named *_LAYOUT.
LAYOUTS = set(typing.get_args(arch.DecodeLayout))


def family_names() -> set[str]:
    names = set()
    for f in (ROOT / "core" / "architectures").glob("*.json"):
        entry = json.loads(f.read_text())
        names.add(entry["family"])
        names.update(entry["model_types"])
    return names


def product_files() -> list[Path]:
    """Every product module (test_layering's list: not tests/, the benchmarks, convert/remote)."""
    return sorted(product_modules().values())


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                ids.add(id(value))
    return ids


def _exported(tree: ast.AST) -> set[int]:
    """ids of the strings of `__all__`: Python names the module defines (eval.records' `opt`
    helper), not family names."""
    return {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for c in ast.walk(node.value) if isinstance(c, ast.Constant)}


def _layout_uses(tree: ast.AST) -> set[int]:
    """ids of the string constants used as decode layout names (see LAYOUTS)."""
    ids = set()

    def strings(node: ast.AST) -> list[ast.Constant]:
        return [n for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal":
            ids.update(id(c) for c in strings(node.slice))
        elif isinstance(node, ast.Dict) and node.keys and all(
                isinstance(k, ast.Constant) and k.value in LAYOUTS for k in node.keys):
            ids.update(id(k) for k in node.keys)
        elif isinstance(node, ast.Compare) and any(
                isinstance(x, ast.Attribute) and x.attr == "decode" for x in [node.left, *node.comparators]):
            ids.update(id(c) for c in strings(node))
        elif isinstance(node, ast.Assign) and all(
                isinstance(t, ast.Name) and t.id.endswith("_LAYOUT") for t in node.targets):
            ids.update(id(c) for c in strings(node.value))
    return ids


def family_names_in(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """`file:line: what` for every family name used as a string constant or an attribute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _docstrings(tree) | _exported(tree)
    layouts = _layout_uses(tree)
    rel = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            name, what = node.value, "string"
            if id(node) in layouts and name in LAYOUTS:
                continue
        elif isinstance(node, ast.Attribute):
            name, what = node.attr, "attribute"
        else:
            continue
        if name in names and (rel, name) not in ALLOWED:
            found.append(f"{rel}:{node.lineno}: {what} {name!r}")
    return found


def test_product_code_names_no_family():
    names = family_names()
    assert {"llama", "gpt_neox", "gpt2", "opt", "t5", "bart", "qwen2"} <= names  # the scan has its targets
    files = product_files()
    assert ROOT / "runtime" / "families.py" in files and ROOT / "convert" / "gguf_in.py" in files
    found = [hit for p in files for hit in family_names_in(p, names)]
    assert not found, ("family knowledge outside the architecture table (move it into the entry, "
                       "core/arch.py): " + "; ".join(found))


@pytest.mark.parametrize("source, hits", [
    ('def f(model):\n    return hasattr(model, "gpt_neox")\n', ["string 'gpt_neox'"]),
    ("def f(model):\n    return model.transformer.h if model.gpt2 else None\n", ["attribute 'gpt2'"]),
    ('GGUF_ARCHS = {"llama": True, "qwen2": False}\n', ["string 'llama'", "string 'qwen2'"]),
    ('def f(spec):\n    return spec.family == "t5"\n', ["string 't5'"]),
    ('def opt():\n    pass\n__all__ = ["opt"]\nNAMES = ["opt"]\n', ["string 'opt'"]),
    ('"""A llama docstring: "llama"."""\nX_LAYOUT = "llama"\nD = {"gpt2": 1, "opt": 2}\n'
     'def f(spec):\n    """t5"""\n    return spec.decode == "t5"\n', []),
])
def test_the_scan_finds_family_names_and_passes_layout_names(tmp_path, source, hits):
    """The scan itself: a family name in a hasattr, an attribute or a name table is found; a
    docstring, and a layout name used as a layout, are not."""
    f = tmp_path / "mod.py"
    f.write_text(source)
    found = family_names_in(f, {"llama", "gpt_neox", "gpt2", "opt", "t5", "qwen2"}, tmp_path)
    assert [h.split(": ", 1)[1] for h in found] == hits


def test_entries_say_their_decode_layout_and_gguf_architecture():
    reg = arch.registry()
    for spec in reg.values():
        assert (spec.decode == "t5") == (spec.is_encoder_decoder and spec.decode is not None)
    assert {f for f, s in reg.items() if s.decode == "t5"} == {"t5", "mt5"}
    assert reg["bart"].decode is None
    assert {f: s.decode for f, s in reg.items() if s.decode not in ("llama", "t5", None)} == {
        "gpt_neox": "gpt_neox", "gpt2": "gpt2", "opt": "opt", "phi": "phi"}
    assert arch.gguf_archs() == {"llama": True, "qwen2": False}


@pytest.mark.parametrize("change, message", [
    ({"decode": "mistral"}, "decode"),
    ({"decode": "t5"}, "encoder-decoder's decoder step"),
    ({"gguf": {"arch": "llama"}}, "permute_qk"),
    ({"gguf": {"arch": "llama", "permute_qk": True, "extra": 1}}, "extra"),
])
def test_decode_and_gguf_fields_are_checked(change, message):
    entry = arch.registry()["llama"].model_dump() | change
    with pytest.raises(ValidationError, match=message):
        arch.ArchSpec.model_validate(entry)


def test_an_encoder_decoder_names_no_decoder_only_layout_and_no_gguf():
    t5 = arch.registry()["t5"].model_dump()
    with pytest.raises(ValidationError, match="decoder-only model's layer layout"):
        arch.ArchSpec.model_validate(t5 | {"decode": "llama"})
    with pytest.raises(ValidationError, match="GGUF input and output are for decoder-only"):
        arch.ArchSpec.model_validate(t5 | {"gguf": {"arch": "t5", "permute_qk": False}})


def test_two_entries_cannot_claim_one_gguf_architecture(monkeypatch):
    from importlib import resources

    real = resources.files

    class Dir:
        def __init__(self, files):
            self.files = files

        def iterdir(self):
            return iter(self.files)

    class File:
        def __init__(self, name, text):
            self.name, self.text = name, text

        def read_text(self):
            return self.text

    llama = arch.registry()["llama"].model_dump()
    twin = llama | {"family": "twin", "model_types": ["twin"], "architectures": ["TwinForCausalLM"]}
    files = [File("llama.json", json.dumps(llama)), File("twin.json", json.dumps(twin))]
    monkeypatch.setattr(arch.resources, "files",
                        lambda pkg: Dir(files) if pkg == "gqakit.core.architectures" else real(pkg))
    arch.registry.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="two entries name one gguf.arch"):
            arch.registry()
    finally:
        monkeypatch.undo()
        arch.registry.cache_clear()


def test_the_fused_decode_layout_comes_from_the_entry(tiny_model, monkeypatch):
    """The fused CPU step checks the layout the model's entry names: a Llama model qualifies as
    `llama`, is refused when its entry names none, and is checked as GPT-2 when it names that."""
    from gqakit.core.loading import load_causal_lm
    from gqakit.runtime.families import layer_specs, layout_problem

    model = load_causal_lm(tiny_model("llama", num_key_value_heads=2))
    assert layout_problem(model) is None
    assert len(layer_specs(model).layers) == model.config.num_hidden_layers
    reg = arch.registry()
    monkeypatch.setitem(reg, "llama", reg["llama"].model_copy(update={"decode": None}))
    assert "names no decoder-layer layout" in layout_problem(model)
    monkeypatch.setitem(reg, "llama", reg["llama"].model_copy(update={"decode": "gpt2"}))
    assert layout_problem(model).startswith("not a GPT-2 stack")


def test_the_t5_step_follows_the_entry(tmp_path, monkeypatch):
    from transformers import AutoModelForSeq2SeqLM

    from gqakit.runtime.t5_step import t5_layout_problem
    from tiny_models import build_seq2seq

    model = AutoModelForSeq2SeqLM.from_pretrained(build_seq2seq("t5", tmp_path / "t5")).eval()
    assert t5_layout_problem(model) is None
    reg = arch.registry()
    monkeypatch.setitem(reg, "t5", reg["t5"].model_copy(update={"decode": None}))
    assert t5_layout_problem(model) == ("the lean encoder-decoder step covers the T5 layout, "
                                        "not T5ForConditionalGeneration")


def test_gguf_architectures_come_from_the_entries():
    from gqakit.convert import gguf_in

    assert gguf_in.GGUF_ARCHS == arch.gguf_archs() == {
        s.gguf.arch: s.gguf.permute_qk for s in arch.registry().values() if s.gguf}
