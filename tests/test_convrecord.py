"""core/convrecord.py: gqakit_convert.json read once, typed, by every stage that asks how a
model was converted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gqakit.convert import convert_checkpoint
from gqakit.core.convrecord import ConversionRecord, RecordedSettings, read_conversion_record


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_what_convert_writes_is_every_declared_field(tiny_model, tmp_path: Path, family: str):
    """Every key `gqakit convert` writes is a field of the model, so nothing is read by a
    string key past it (a field renamed on one side only fails here)."""
    from tiny_models import build_seq2seq

    src = build_seq2seq(family, tmp_path / "src") if family == "t5" else tiny_model(family)
    out = convert_checkpoint(src, tmp_path / "out", 2, method="mean", progress=False)
    raw = json.loads((Path(out) / "gqakit_convert.json").read_text())
    rec = read_conversion_record(out)
    assert rec is not None and rec.has_settings
    assert set(raw) <= set(ConversionRecord.model_fields), set(raw) - set(ConversionRecord.model_fields)
    assert rec.model_extra == {} and rec.settings.method == "mean" and rec.num_kv_heads == 2
    assert rec.family == raw["family"] and rec.settings.source == raw["settings"]["source"]
    assert (rec.grouped is not None) == (family == "t5")
    assert set(RecordedSettings.model_fields) <= set(raw["settings"])


def test_an_older_or_damaged_record_reads_field_by_field(tmp_path: Path):
    (tmp_path / "gqakit_convert.json").write_text(json.dumps({
        "settings": {"method": "mean", "grouping": 3, "future_option": 1},   # grouping of the wrong type
        "num_kv_heads": "2",                                                 # a string is not coerced
        "calibration": "not an object", "family": "llama", "a_later_field": [1]}))
    rec = read_conversion_record(tmp_path)
    assert rec.family == "llama" and rec.num_kv_heads is None and rec.calibration is None
    assert rec.settings.method == "mean" and rec.settings.grouping is None and rec.has_settings
    assert rec.model_extra == {"a_later_field": [1]} and rec.gqakit_version is None


@pytest.mark.parametrize("text", ["", "[1, 2]", "{not json", "\xff"])
def test_no_record_where_the_file_is_not_an_object(tmp_path: Path, text: str):
    (tmp_path / "gqakit_convert.json").write_text(text, encoding="latin-1")
    assert read_conversion_record(tmp_path) is None
    assert read_conversion_record(tmp_path / "absent") is None


def test_settings_that_are_not_an_object_are_not_settings(tmp_path: Path):
    (tmp_path / "gqakit_convert.json").write_text(json.dumps({"settings": "mean", "num_kv_heads": 2}))
    rec = read_conversion_record(tmp_path)
    assert not rec.has_settings and rec.settings.method is None and rec.num_kv_heads == 2


def test_provenance_and_lineage_read_the_typed_record(tmp_path: Path):
    from gqakit.eval.provenance import conversion_info
    from gqakit.uptrain.export import source_lineage

    (tmp_path / "gqakit_convert.json").write_text(json.dumps({
        "settings": {"method": "align", "grouping": "similarity", "source": "org/m"}, "num_kv_heads": 2,
        "num_kv_heads_before": 8, "family": "llama", "num_heads": 8, "gqakit_version": "0.1",
        "calibration": {"tokens": 64}}))
    info = conversion_info(tmp_path)
    assert (info.method, info.num_kv_heads, info.grouping) == ("align", 2, "similarity")
    source, conversion = source_lineage(tmp_path)
    assert source == {"step": "source", "model": "org/m", "family": "llama", "query heads": 8, "KV heads": 8}
    assert conversion["KV heads"] == "8 → 2" and conversion["calibration tokens"] == 64
    assert conversion["tool"] == "gqakit convert (gqakit 0.1)" and conversion["method"] == "align"
    (tmp_path / "gqakit_convert.json").write_text(json.dumps({"settings": {"method": "mean"}}))
    assert conversion_info(tmp_path) is None  # no G: not a record eval can report
