"""Write the trained model as a self-contained Hugging Face folder, atomically.

The folder holds what a convert output holds and loads the same way: a stock class
through `AutoModelForCausalLM`, or gqakit's own modeling file through `auto_map` (which
`core.loading.load_causal_lm` trusts automatically). The tokenizer and generation files
are the converted folder's own, copied verbatim (`core.modelfiles.side_files`: a
sentencepiece `tokenizer.model` included, which llama.cpp's converter reads). It keeps
the convert record (`gqakit_convert.json`: which projections changed) and card, adds the
resolved uptrain settings with the result and the lineage (`gqakit_uptrain.yaml`), and
card sections with the training facts and the whole lineage: source, conversion,
uptraining. It is built in a hidden temp folder and renamed into place only when
complete, so an interrupted run never leaves a finished-looking model behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

import gqakit
from gqakit.core.convrecord import read_conversion_record
from gqakit.core.loading import CONVERT_SETTINGS, REMOTE_PREFIX, UPTRAIN_SETTINGS
from gqakit.core.modelcard import append_section, lineage_body, set_section
from gqakit.core.modelfiles import side_files
from gqakit.core.outdir import atomic_output_dir
from gqakit.core.units import config_dtype, torch_dtype
from gqakit.core.yamlfile import read_yaml

# Files carried over from the converted folder when save_pretrained does not write them.
CARRY = (CONVERT_SETTINGS, "README.md")


def frozen_from_source(state_dict: dict[str, torch.Tensor], src: Path) -> dict[str, torch.Tensor]:
    """Frozen weights trained in the compute dtype (the only tensors not in fp32) are written
    as the source folder holds them, so a frozen weight leaves the run bit for bit unchanged."""
    low = {k for k, v in state_dict.items() if v.is_floating_point() and v.dtype != torch.float32}
    if not low:
        return state_dict
    from safetensors import safe_open

    out = dict(state_dict)
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in low & set(h.keys()):
                out[k] = h.get_tensor(k)
    return out


def _read(path: Path, parse: Any) -> Any:
    """PATH parsed, or None when it is missing or not what gqakit writes (the lineage then
    starts later; the run is not failed for a damaged record)."""
    try:
        return parse(path) if path.is_file() else None
    except (OSError, ValueError, yaml.YAMLError):  # read_yaml's limits raise a ValueError too
        return None


def source_lineage(src: Path) -> list[dict[str, Any]]:
    """The steps that made SRC, oldest first: the lineage its own `gqakit_uptrain.yaml`
    records (SRC was uptrained before), else the source and the conversion its
    `gqakit_convert.json` records, else SRC alone."""
    up = _read(src / UPTRAIN_SETTINGS, read_yaml) if src.is_dir() else None
    steps = up.get("lineage") if isinstance(up, dict) else None
    if isinstance(steps, list) and steps and all(isinstance(st, dict) and "step" in st for st in steps):
        return steps
    rec = read_conversion_record(src) if src.is_dir() else None
    if rec is None or not rec.has_settings:
        return [{"step": "source", "model": str(src)}]
    s, before, g = rec.settings, rec.num_kv_heads_before, rec.num_kv_heads
    if g is None:  # a per-layer conversion: each layer's KV heads
        before, g = getattr(rec, "kv_heads_before", before), getattr(rec, "kv_heads", None)
    calibration = rec.calibration or {}
    return [{"step": "source", "model": s.source, "family": rec.family,
             "query heads": rec.num_heads, "KV heads": before},
            {"step": "conversion", "tool": f"gqakit convert (gqakit {rec.gqakit_version})",
             "output": str(src), "method": s.method, "grouping": s.grouping,
             "KV heads": f"{before} → {g}", "G": g, "calibration tokens": calibration.get("tokens"),
             "record": CONVERT_SETTINGS}]


def uptrain_step(src: Path, settings: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    """This run as one lineage step: what it started from, its recipe's main settings, and
    its result (tokens, optimizer steps, the final losses)."""
    train, data, teacher = settings.get("train", {}), settings.get("data", {}), settings.get("teacher", {})
    return {"step": "uptraining", "tool": f"gqakit uptrain (gqakit {gqakit.__version__})", "from": str(src),
            "objective": data.get("objective"), "teacher": teacher.get("path"),
            "lora": "yes" if train.get("lora") else None, "seq_len": train.get("seq_len"), "lr": train.get("lr"),
            "tokens": facts.get("tokens"), "optimizer steps": facts.get("optimizer steps"),
            "final train loss": facts.get("final train loss"), "final held-out loss": facts.get("held-out loss"),
            "held-out perplexity": facts.get("held-out perplexity"), "recipe": UPTRAIN_SETTINGS}


def copy_model_files(src: Path, tmp: Path, tokenizer: Any) -> None:
    """The tokenizer and generation files of SRC, verbatim, as convert copies them from its
    source; the loaded tokenizer is saved only when SRC has no tokenizer file of its own.
    Then the convert record, the card, and the remote modeling file of a family without
    stock GQA."""
    carried = side_files(src) if src.is_dir() else []
    if not any(p.name != "generation_config.json" for p in carried):
        tokenizer.save_pretrained(tmp)
    for p in carried:
        shutil.copy2(p, tmp / p.name)
    for name in CARRY:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    # Remote-code families: the modeling file and auto_map must survive the round trip.
    for py in src.glob(f"{REMOTE_PREFIX}*.py"):
        if not (tmp / py.name).is_file():
            shutil.copy2(py, tmp / py.name)


def export_model(model: Any, state_dict: dict[str, torch.Tensor], tokenizer: Any, *, src: Path, out: Path,
                 settings: dict[str, Any], facts: dict[str, Any]) -> Path:
    """Save `model` (with `state_dict`, gathered from all processes) to `out`; returns `out`."""
    src_cfg = json.loads((src / "config.json").read_text())
    state_dict = frozen_from_source(state_dict, src)
    dtype = torch_dtype(config_dtype(src_cfg) or "float32")  # the dtype SRC's weights are saved in
    if dtype in (torch.float16, torch.bfloat16):
        # Training keeps fp32 master weights; hand back the precision the input came in.
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    with atomic_output_dir(out, overwrite=True) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        copy_model_files(src, tmp, tokenizer)
        if "auto_map" in src_cfg:
            cfg = json.loads((tmp / "config.json").read_text())
            cfg["auto_map"] = src_cfg["auto_map"]
            if dtype in (torch.float16, torch.bfloat16):
                cfg["dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        lineage = [*source_lineage(src), uptrain_step(src, settings, facts)]
        (tmp / UPTRAIN_SETTINGS).write_text(yaml.safe_dump({"settings": settings, "result": facts,
                                                            "lineage": lineage}, sort_keys=False, allow_unicode=True))
        body = ["Continued pre-training with `gqakit uptrain` (Ainslie et al. 2023, uptraining).", "",
                "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in facts.items()]
        body += ["", f"Exact settings: `{UPTRAIN_SETTINGS}`."]
        append_section(tmp / "README.md", "Uptraining", "\n".join(body))
        set_section(tmp / "README.md", "Lineage", lineage_body(lineage))
    return out
