"""The conversion record: `gqakit_convert.json`, which `gqakit convert` writes into OUT.

Read here, once, into a typed model, by every stage that asks how a model was converted
(uptrain's LoRA targets and lineage, eval's provenance and seen-data check). Every field is
optional and unknown keys are kept, so a record written by an older or newer gqakit reads:
a field that is absent or malformed is None, and the reader decides whether it needs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from gqakit.core.loading import CONVERT_SETTINGS


class _Tolerant(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)  # JSON types as written, no coercion

    @classmethod
    def tolerant(cls, data: Any) -> Any:
        """The model of DATA with every top-level field that does not validate left out;
        None when DATA is not a JSON object."""
        if not isinstance(data, dict):
            return None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            bad = {err["loc"][0] for err in e.errors() if err["loc"]}
            return cls.model_validate({k: v for k, v in data.items() if k not in bad})


class RecordedSettings(_Tolerant):
    """The conversion's settings as recorded (`ConvertSettings.record()`): the ones read back."""

    source: str | None = None
    method: str | None = None
    grouping: str | None = None
    num_kv_heads: int | None = None
    calibration_data: str | None = None


class ConversionRecord(_Tolerant):
    """What `gqakit_convert.json` says about a converted model."""

    gqakit_version: str | None = None
    settings: RecordedSettings = RecordedSettings()
    family: str | None = None
    num_heads: int | None = None
    num_kv_heads_before: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    num_layers: int | None = None
    parameters_before: int | None = None
    parameters_after: int | None = None
    kv_cache_bytes_per_token_before: int | None = None
    kv_cache_bytes_per_token_after: int | None = None
    kv_cache_dtype: str | None = None
    seconds: float | None = None
    copied_files: list[str] | None = None
    loads_with: str | None = None
    # encoder-decoders: the attentions grouped (core.arch.SITE_NAMES' names) and the encoder
    grouped: list[str] | None = None
    encoder_num_layers: int | None = None
    encoder_num_heads: int | None = None
    encoder_num_kv_heads_before: int | None = None
    encoder_num_kv_heads: int | None = None
    calibration: dict[str, Any] | None = None  # the calibration stage's record (align-refit)
    # per grouped attention (core.arch.SITE_NAMES' names): the projections whose values the method changed
    changed: dict[str, list[str]] | None = None

    @classmethod
    def tolerant(cls, data: Any) -> ConversionRecord | None:
        rec = super().tolerant(data)
        if rec is not None and isinstance(data.get("settings"), dict):  # its valid fields, when some are not
            rec = rec.model_copy(update={"settings": RecordedSettings.tolerant(data["settings"])})
        return rec

    @property
    def has_settings(self) -> bool:
        """The record holds the conversion's settings (an object, though some may be unreadable)."""
        return "settings" in self.model_fields_set


def read_conversion_record(folder: str | Path) -> ConversionRecord | None:
    """The record in FOLDER's `gqakit_convert.json`; None where there is none, or it is not a
    JSON object (a folder not made by `gqakit convert`, or a damaged file)."""
    path = Path(folder) / CONVERT_SETTINGS
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return ConversionRecord.tolerant(data)
