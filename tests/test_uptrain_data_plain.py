"""Without `datasets`, local text, JSON lines and in-memory documents give the same blocks.

A GPU image may lack `datasets` (gqakit's GPU proof runs there): the plain-Python reader
must split, tokenize and pack exactly as the `datasets` path does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gqakit.core.errors import GqakitError
from gqakit.uptrain import data as data_mod
from gqakit.uptrain.config import DataCfg
from tiny_models import tiny_tokenizer

# Pico tokenizer: single characters 33..93 separated by whitespace; blank lines, a
# whitespace-only paragraph, CRLF line ends and a trailing newline are the edge cases.
DOCS = [" ".join(chr(33 + (i * 7 + j * 3) % 61) for j in range(20 + i % 9)) for i in range(30)]
RAW = "\n\n".join(DOCS[:10]) + "\n\n\n\n   \n\n" + "\r\n".join(DOCS[10:20]) + "\n\n" + "\n".join(DOCS[20:]) + "\n"


def both(cfg: DataCfg, monkeypatch) -> tuple[tuple, tuple]:
    tok = tiny_tokenizer()
    with_ds = data_mod.build_blocks(cfg, tok, 8)
    monkeypatch.setattr(data_mod, "have_datasets", lambda: False)
    without = data_mod.build_blocks(cfg, tok, 8)
    return with_ds, without


@pytest.mark.parametrize("sample_by", ["line", "paragraph", "document"])
def test_text_files_give_the_same_blocks_without_datasets(sample_by: str, tmp_path: Path, monkeypatch):
    f = tmp_path / "train.txt"
    f.write_bytes(RAW.encode())
    held = tmp_path / "held.txt"
    held.write_text("\n\n".join(DOCS[:5]))
    cfg = DataCfg(files=[str(f)], eval_file=str(held), sample_by=sample_by, add_bos=True,
                  cache_dir=str(tmp_path / "cache"))
    (train_a, eval_a), (train_b, eval_b) = both(cfg, monkeypatch)
    assert train_a.shape[0] > 0
    torch.testing.assert_close(train_a, train_b, rtol=0, atol=0)
    torch.testing.assert_close(eval_a, eval_b, rtol=0, atol=0)


def test_jsonl_and_in_memory_documents_without_datasets(tmp_path: Path, monkeypatch):
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    cfg = DataCfg(files=[str(f)], text_field="body", cache_dir=str(tmp_path / "cache"))
    (a, _), (b, _) = both(cfg, monkeypatch)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    cfg = DataCfg(texts=DOCS, eval_texts=DOCS[:4], cache_dir=str(tmp_path / "cache"))
    (a, ea), (b, eb) = both(cfg, monkeypatch)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(ea, eb, rtol=0, atol=0)


def test_what_needs_datasets_says_so(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(data_mod, "have_datasets", lambda: False)
    f = tmp_path / "train.parquet"
    f.write_bytes(b"PAR1")
    with pytest.raises(GqakitError, match="parquet files need the `datasets` package"):
        data_mod.build_blocks(DataCfg(files=[str(f)]), tiny_tokenizer(), 8)
    with pytest.raises(GqakitError, match="hf_dataset: needs the `datasets` package"):
        data_mod.build_blocks(DataCfg(hf_dataset="wikitext"), tiny_tokenizer(), 8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b"}\n{"other": 1}\n')
    with pytest.raises(GqakitError, match="line 2 has no field 'text'"):
        data_mod.build_blocks(DataCfg(files=[str(bad)]), tiny_tokenizer(), 8)
