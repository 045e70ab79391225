"""What an interrupted calibration resumes from: the calibration tokens, both streams and a
small state (layers done, drift so far, the names of the tensors the writer holds): the resume
state, saved under `RESUME_DIR/state` atomically: a kill during a save keeps the previous one.
Anything else in `RESUME_DIR` is not read: a partial folder without a resume state restarts
its calibration from the first layer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gqakit.convert.calibration.streams import Streams
from gqakit.core.outdir import swap_in

STATE = "state"


def load_state(resume_dir: Path | None) -> dict[str, Any] | None:
    """The state an interrupted run saved under `resume_dir` (None when there is none)."""
    if resume_dir is None or not (resume_dir / STATE / "state.json").is_file():
        return None
    try:
        return json.loads((resume_dir / STATE / "state.json").read_text())
    except (OSError, ValueError):
        return None


def load_tokens(resume_dir: Path) -> Tensor:
    """The calibration tokens saved with the resume state."""
    return torch.load(resume_dir / STATE / "seqs.pt")


def save_state(resume_dir: Path, seqs: Tensor, streams: Streams, state: dict[str, Any]) -> None:
    """Save what a resumed run needs: a new folder, renamed over the old one."""
    tmp, final = resume_dir / (STATE + ".tmp"), resume_dir / STATE
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(seqs, tmp / "seqs.pt")
    streams.save(tmp)
    (tmp / "state.json").write_text(json.dumps(state) + "\n")
    swap_in(tmp, final)
