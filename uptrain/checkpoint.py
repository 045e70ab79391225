"""Checkpoints of an uptrain run: save, verify, find the newest intact one, restore.

A checkpoint is `output.dir/checkpoints/step-N/`: accelerate's `save_state` (weights,
optimizer, RNG streams of every process) plus `trainer_state.json`, the record of the
step, the loss, the data's fingerprint and the sha256 of every other file. It is built in
`.step-N.tmp` and swapped into place whole (`core.outdir.swap_in`), so a kill during a
save keeps the previous checkpoint.

Nothing non-finite is ever saved: `nonfinite` checks the loss's gradients, every update
and, before a save, the weights and the optimizer state (a diverging run stops with
`Diverged`, naming the last good checkpoint). `--resume` verifies the hashes first
(`damage`) and names the damaged file and the newest intact earlier checkpoint.

Reading and verifying need no torch (preflight uses them before torch is imported);
saving, restoring and the NaN checks import it when called.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError, first_line
from gqakit.core.files import file_sha256
from gqakit.core.modelfiles import read_st_header
from gqakit.core.outdir import describe_oserror, swap_in
from gqakit.core.outrule import CHECKPOINT_RECORD, CHECKPOINTS

CKPT_DIR = CHECKPOINTS
STATE_FILE = CHECKPOINT_RECORD


class Diverged(GqakitError):
    """Training produced NaN/inf: stopped before the bad values reach a checkpoint."""


# ----------------------------------------------------------------------------- reading and verifying


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the run's checkpoints, oldest first (a folder needs its state file)."""
    found = []
    for p in (out / CKPT_DIR).glob("step-*"):
        if (p / STATE_FILE).is_file() and p.name[5:].isdigit():
            found.append((int(p.name[5:]), p))
    return sorted(found)


def checkpoint_files(ckpt: Path) -> dict[str, str]:
    """sha256 of every file of a checkpoint but its state file (recorded in the state file)."""
    return {str(p.relative_to(ckpt)): file_sha256(p) for p in sorted(ckpt.rglob("*"))
            if p.is_file() and p.name != STATE_FILE}


def read_state(ckpt: Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint; ValueError says what is wrong with it."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{STATE_FILE}: not valid JSON ({first_line(e, 120)})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or isinstance(state.get("step"), bool):
        raise ValueError(f"{STATE_FILE}: no integer 'step'")
    if state["step"] != int(ckpt.name[5:]):
        raise ValueError(f"{STATE_FILE}: step {state['step']} does not match the folder name")
    return state


def damage(ckpt: Path) -> str | None:
    """None when the checkpoint is whole, else 'FILE: what is wrong'.

    Checkpoints written by this version record the sha256 of each file; older ones are
    checked for structure (safetensors header and size, the zip CRCs of torch files).
    """
    try:
        state = read_state(ckpt)
    except ValueError as e:
        return str(e)
    recorded = state.get("files")
    if isinstance(recorded, dict):
        for rel, digest in recorded.items():
            p = ckpt / rel
            if not p.is_file():
                return f"{rel}: missing"
            if file_sha256(p) != digest:
                return f"{rel}: its content differs from what was saved (damaged or changed)"
        return None
    for p in sorted(ckpt.rglob("*")):
        if not p.is_file() or p.name == STATE_FILE:
            continue
        rel = str(p.relative_to(ckpt))
        try:
            if p.suffix == ".safetensors":
                read_st_header(p)
            elif p.suffix in (".bin", ".pkl", ".pt"):
                with zipfile.ZipFile(p) as z:
                    bad = z.testzip()
                if bad is not None:
                    return f"{rel}: member {bad} is corrupt"
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            return f"{rel}: truncated or corrupt ({first_line(e, 120)})"
    return None


def intact_before(out: Path, step: int) -> Path | None:
    """The newest checkpoint older than STEP that is whole."""
    for s, p in reversed(checkpoints(out)):
        if s < step and damage(p) is None:
            return p
    return None


def damaged_message(ckpt: Path, what: str, out: Path) -> str:
    step = int(ckpt.name[5:])
    good = intact_before(out, step)
    hint = (f"{good.name} is intact: move {ckpt} away and run --resume again to continue from it"
            if good is not None else "no earlier checkpoint is intact: start again with --overwrite")
    return f"--resume: checkpoint {ckpt.name} is damaged ({what}); {hint}"


def last_good(out: Path) -> str:
    """The last checkpoint, in words, for messages about a run that stopped."""
    last = checkpoints(out)
    return f"the last good checkpoint is {last[-1][1]}" if last else "no checkpoint was saved yet"


# ----------------------------------------------------------------------------- NaN checks


def nonfinite(accelerator: Any, tensors: Iterable[Any]) -> bool:
    """True when any tensor on any process holds NaN or inf."""
    import torch

    dev = accelerator.device
    # (optimizer state mixes devices: AdamW keeps its step counters on the CPU)
    # (FSDP2 shards are DTensors: each process checks its local shard, the reduce sums up)
    local = [x.to_local() if hasattr(x, "to_local") else x for x in tensors]
    flags = [torch.isfinite(x).all().to(dev) for x in local if x.is_floating_point() and x.numel()]
    bad = (~torch.stack(flags).all()).float() if flags else torch.zeros((), device=dev)
    return bool(accelerator.reduce(bad.to(accelerator.device).reshape(1), "sum").item() > 0)


def optimizer_tensors(optimizer: Any) -> Iterable[Any]:
    import torch

    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                yield v


# ----------------------------------------------------------------------------- save and restore


def _write_failed(e: BaseException, path: Path) -> GqakitError:
    if isinstance(e, OSError):
        return GqakitError(describe_oserror(e, path))
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return GqakitError(f"could not write {path} (disk full or over quota?): {first}")


def save_checkpoint(accelerator: Any, out: Path, step: int, state: dict[str, Any], keep_last: int,
                    model: Any = None, optimizer: Any = None) -> None:
    """accelerate.save_state into a temp folder, swapped in when complete (SIGKILL-safe).

    Never writes non-finite values: the weights and the optimizer state are checked first.
    The sha256 of every file goes into trainer_state.json, so `--resume` can tell a damaged
    checkpoint from a whole one. A failed write (disk full, quota) removes the temp folder
    and becomes one line naming the path.
    """
    final = out / CKPT_DIR / f"step-{step}"
    tmp = out / CKPT_DIR / f".step-{step}.tmp"  # the same name on every process: they all write into it
    if model is not None and nonfinite(accelerator, [*model.parameters(), *optimizer_tensors(optimizer)]):
        raise Diverged(f"the state at step {step} holds NaN/inf values; not saved; {last_good(out)}; lower train.lr?")
    failed: BaseException | None = None
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        failed = e
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and failed is None:
        try:
            state = {**state, "files": checkpoint_files(tmp)}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            swap_in(tmp, final)
        except OSError as e:
            failed = e
        else:
            for _, old in checkpoints(out)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    if failed is not None:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(failed, tmp)
    accelerator.wait_for_everyone()


def restore(accelerator: Any, out: Path, step: int) -> None:
    """Load weights, optimizer and RNG streams of checkpoint STEP; a file that does not load
    is one line naming it and the newest intact earlier checkpoint."""
    ckpt = out / CKPT_DIR / f"step-{step}"
    try:
        accelerator.load_state(str(ckpt))
    except Exception as e:  # accelerate and torch raise many types for a file they cannot read
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise GqakitError(damaged_message(ckpt, f"it does not load: {first}", out)) from None
