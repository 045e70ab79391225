"""core/units.py: the one size parser and the one dtype table every stage reads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gqakit.core.errors import GqakitError
from gqakit.core.units import COMPUTE_DTYPES, DTYPE_BYTES, DTYPES, dtype_named, parse_size, torch_dtype


@pytest.mark.parametrize("text, gb, expected", [
    ("2GB", 1000, 2 * 10**9), ("500MB", 1000, 500 * 10**6), ("10KB", 1000, 10_000), ("7", 1000, 7),
    (" 1.5 gb ", 1000, 1_500_000_000), ("2GiB", 1000, 2 * 2**30), ("2GB", 1024, 2 * 2**30),
    ("24576MiB", 1024, 24 * 2**30), (123, 1000, 123),
])
def test_sizes_in_both_conventions(text, gb, expected):
    assert parse_size(text, gb=gb) == expected


def test_a_bare_number_takes_the_default_unit():
    assert parse_size("80", gb=1024, default_unit="G") == 80 * 2**30
    assert parse_size("80") == 80


@pytest.mark.parametrize("text", ["nonsense", "-1GB", "1XB", "2iB", ""])
def test_a_spelling_that_is_not_a_size_is_one_line(text):
    with pytest.raises(GqakitError, match="invalid size"):
        parse_size(text)
    with pytest.raises(GqakitError, match=r"^--opt: .* is not a size such as 80GB or 24GiB$"):
        parse_size(text, what="--opt")


def test_a_named_option_refuses_zero_in_its_own_words():
    assert parse_size("0") == 0  # unnamed: the caller checks the value
    with pytest.raises(GqakitError, match="^--opt: '0MB' must be more than zero$"):
        parse_size("0MB", what="--opt")


def test_the_dtype_table():
    assert COMPUTE_DTYPES == ("float32", "bfloat16", "float16")
    assert DTYPE_BYTES["bfloat16"] == 2 and DTYPE_BYTES["float64"] == 8 and DTYPE_BYTES["float8_e5m2"] == 1
    assert dtype_named("bf16") is dtype_named("torch.bfloat16") is DTYPES["bfloat16"]
    assert dtype_named("fp32").bytes == 4 and dtype_named("fp16").name == "float16"
    assert dtype_named("int8") is None
    import torch

    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("float32") is torch.float32
    for d in DTYPES.values():  # every name in the table is torch's own
        assert getattr(torch, d.name).itemsize == d.bytes
    with pytest.raises(KeyError):
        torch_dtype("int8")


def test_the_table_imports_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from gqakit.core.units import dtype_named, parse_size\n"
            "assert dtype_named('bf16').bytes == 2 and parse_size('1KB') == 1000")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_uptrain_export_saves_in_the_sources_dtype(tmp_path):
    """The export reads SRC's saved dtype (`dtype`, as transformers now writes it) through the one table."""
    import json

    import torch
    from safetensors import safe_open
    from tiny_models import build

    from gqakit.core.loading import load_causal_lm, load_tokenizer
    from gqakit.uptrain.export import export_model

    src = build("llama", tmp_path / "src", dtype=torch.bfloat16)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"
    (src / "config.json").write_text(json.dumps(cfg))
    model = load_causal_lm(src, dtype=torch.float32, device="cpu")
    out = export_model(model, model.state_dict(), load_tokenizer(src), src=src, out=tmp_path / "out",
                       settings={}, facts={})
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
