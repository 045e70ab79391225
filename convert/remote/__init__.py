"""Modeling files for families whose stock transformers class has no GQA support, and for the
per-layer outputs of those whose class reads one KV-head count for every layer (the table's
`remote.per_layer_only`: their uniform outputs are stock folders, without a file).

`gqakit convert` copies `modeling_file(family)` next to the converted weights and merges
`remote_config_updates(family, G)` into config.json; stock transformers then loads the folder
with `trust_remote_code=True` (gqakit's `core.loading` enables it for these files only).
The modeling files import only torch and transformers, never gqakit. Their class names
are the `remote` entry of the family's JSON file in `core/architectures/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gqakit.core.arch import Remote, registry
from gqakit.core.errors import GqakitError


_HERE = Path(__file__).resolve().parent


def _family(family: str) -> Remote:
    """The table's `remote` entry of `family` (its modeling file's class names)."""
    spec = registry().get(family)
    if spec is None or spec.remote is None:
        have = [f for f, s in registry().items() if s.remote is not None]
        raise GqakitError(f"no gqakit modeling file for model family {family!r} (have: {', '.join(have)})")
    return spec.remote


def modeling_file(family: str) -> Path:
    """Path of the family's modeling file (`gqakit_modeling_<family>.py`, or the module its
    `remote` entry names), to copy into the output folder under the same name."""
    fam = _family(family)
    return _HERE / f"{fam.module or f'gqakit_modeling_{family}'}.py"


def remote_config_updates(family: str, num_kv_heads: int, *, encoder_kv_heads: int | None = None) -> dict[str, Any]:
    """Keys to add/replace in config.json so the folder loads with the GQA modeling file.

    An encoder-decoder's `num_kv_heads` are its decoder's (self- and cross-attention), and
    `encoder_kv_heads` its encoder's; it loads with AutoModelForSeq2SeqLM."""
    fam = _family(family)
    module = modeling_file(family).stem
    seq2seq = registry()[family].is_encoder_decoder
    updates: dict[str, Any] = {
        "model_type": f"gqakit_{family}",
        "num_key_value_heads": int(num_kv_heads),
        "architectures": [fam.model_class],
        "auto_map": {
            "AutoConfig": f"{module}.{fam.config_class}",
            "AutoModelForSeq2SeqLM" if seq2seq else "AutoModelForCausalLM": f"{module}.{fam.model_class}",
        },
    }
    key = registry()[family].config.num_kv_heads
    if key and key != "num_key_value_heads":  # the family's own key, which the table reads
        updates[key] = int(num_kv_heads)
    if seq2seq:
        if encoder_kv_heads is None:
            raise ValueError(f"{family} is an encoder-decoder: give encoder_kv_heads")
        updates["encoder_num_key_value_heads"] = int(encoder_kv_heads)
    return updates
