"""Write the trained model as a self-contained Hugging Face folder, atomically.

The folder loads exactly as the convert output does: a stock class through
`AutoModelForCausalLM`, or gqakit's own modeling file through `auto_map` (which
`core.loading.load_causal_lm` trusts automatically). It keeps the convert marker and
card, adds the resolved uptrain settings (`gqakit_uptrain.yaml`) and a card section with
the training facts. It is built in a hidden temp folder and renamed into place only when
complete, so an interrupted run never leaves a finished-looking model behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from gqakit.core.loading import CONVERT_SETTINGS, REMOTE_PREFIX, UPTRAIN_SETTINGS
from gqakit.core.modelcard import append_section
from gqakit.core.outdir import atomic_output_dir

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


def export_model(model: Any, state_dict: dict[str, torch.Tensor], tokenizer: Any, *, src: Path, out: Path,
                 settings: dict[str, Any], facts: dict[str, Any]) -> Path:
    """Save `model` (with `state_dict`, gathered from all processes) to `out`; returns `out`."""
    src_cfg = json.loads((src / "config.json").read_text())
    state_dict = frozen_from_source(state_dict, src)
    dtype = getattr(torch, str(src_cfg.get("dtype") or src_cfg.get("torch_dtype") or "float32"), torch.float32)
    if dtype in (torch.float16, torch.bfloat16):
        # Training keeps fp32 master weights; hand back the precision the input came in.
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    with atomic_output_dir(out, overwrite=True) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name in CARRY:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        # Remote-code families: the modeling file and auto_map must survive the round trip.
        for py in src.glob(f"{REMOTE_PREFIX}*.py"):
            if not (tmp / py.name).is_file():
                shutil.copy2(py, tmp / py.name)
        if "auto_map" in src_cfg:
            cfg = json.loads((tmp / "config.json").read_text())
            cfg["auto_map"] = src_cfg["auto_map"]
            if dtype in (torch.float16, torch.bfloat16):
                cfg["dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / UPTRAIN_SETTINGS).write_text(yaml.safe_dump({"settings": settings, "result": facts}, sort_keys=False))
        body = ["Continued pre-training with `gqakit uptrain` (Ainslie et al. 2023, uptraining).", "",
                "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in facts.items()]
        body += ["", f"Exact settings: `{UPTRAIN_SETTINGS}`."]
        append_section(tmp / "README.md", "Uptraining", "\n".join(body))
    return out
