"""The uptraining memory plan: the peak device memory of one process, by part, before a run.

`gqakit uptrain CONFIG --dry-run` prints it; a real run writes the same figure as the
first row of log.jsonl. Nothing is loaded but config.json: the model is built with fake
tensors (`memory.count_model`), which gives exact parameter counts and the activations
the real model code and loss keep for the backward pass.

Per process, with P_t trained parameters (N processes under FSDP divide the model state):

- weights: trained ones fp32 (the master copy), frozen ones in the compute dtype; with
  `train.lora` the trained ones are the adapters (r x (in + out) per target projection)
  and every base weight is frozen;
- gradients: fp32, of what trains (4 P_t bytes);
- optimizer state: AdamW's two fp32 moments (8 P_t bytes);
- optimizer step scratch: on a GPU torch's multi-tensor AdamW holds one more fp32 copy
  of the trained weights while it steps (4 P_t bytes);
- activations of `seq_len` x `micro_batch` (with gradient checkpointing: every block's
  input plus one block recomputed), and the backward scratch (the gradients of the
  largest saved tensors, the logits, while the backward pass starts);
- the teacher's weights (fp32, on every process);
- DDP: its gradient buckets (4 P_t bytes); FSDP: the blocks gathered for compute.

The peak is the model state plus the larger of the backward pass (activations and
scratch) and the optimizer step (gradients and step scratch).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError, first_line
from gqakit.core.units import dtype_named, parse_size
from gqakit.uptrain.lora import short_targets

GIB = 2**30
ATTENTION = ["self_attn"]   # the weights conversion changed: train.trainable for attention only


@dataclass(frozen=True)
class Target:
    """Where the run executes: its processes, their sharding and the device kind."""

    processes: int = 1
    sharding: str = "none"        # "none", "ddp" or "fsdp"
    device: str = "cuda"          # "cuda" or "cpu"

    def describe(self) -> str:
        how = {"none": "", "ddp": " (DDP)", "fsdp": " (FSDP)"}[self.sharding]
        return f"{self.processes} x {self.device}{how}"


@dataclass(frozen=True)
class LoraPlan:
    """`train.lora` with its targets resolved (as `lora.resolve_targets` does for the run)."""

    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Settings:
    """The run settings the plan depends on (and that a suggestion may change)."""

    seq_len: int
    micro_batch: int
    grad_accum: int
    checkpointing: bool
    trainable: tuple[str, ...] | None
    precision: str                 # resolved: bf16, fp16 or fp32
    lora: LoraPlan | None = None   # adapters instead of `trainable`


@dataclass
class MemoryPlan:
    settings: Settings
    target: Target
    params: int
    trained: int
    parts: dict[str, int]          # bytes per process, in print order
    peak: int
    activations_other: int = 0     # activations with the other gradient_checkpointing setting
    counts: Any = None             # the model count it was composed from (`memory.Counts`)

    def row(self) -> dict[str, Any]:
        """The plan as a log.jsonl row."""
        s = self.settings
        return {"step": 0, "memory_plan": {
            "peak_bytes": self.peak, "parts_bytes": dict(self.parts), "params": self.params, "trained": self.trained,
            "processes": self.target.processes, "sharding": self.target.sharding, "device": self.target.device,
            "seq_len": s.seq_len, "micro_batch": s.micro_batch, "gradient_checkpointing": s.checkpointing,
            "precision": s.precision,
            **({"lora": {"r": s.lora.r, "targets": list(s.lora.targets)}} if s.lora else {})}}


# ----------------------------------------------------------------------------- sizes


def device_memory_size(text: str) -> int:
    """--device-memory: '80', '80G', '80GB', '80GiB', '24576MiB' -> bytes (G and GB are GiB, as GPUs are sold)."""
    return parse_size(text, gb=1024, default_unit="G", what="--device-memory")


def gib(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- targets


def target_from_accelerate_config(path: str | Path, device: str) -> Target:
    """The processes and sharding an accelerate config file sets up."""
    from gqakit.core.yamlfile import YamlError, read_yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise GqakitError(f"--accelerate-config: {p} is not a file")
    try:
        tree = read_yaml(p)
    except YamlError as e:
        raise GqakitError(f"--accelerate-config: {e}") from None
    if not isinstance(tree, dict):
        raise GqakitError(f"--accelerate-config: {p} does not hold accelerate settings")
    dist = str(tree.get("distributed_type", "NO")).upper()
    n = tree.get("num_processes", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise GqakitError(f"--accelerate-config: num_processes in {p} must be a positive integer, got {n!r}")
    if tree.get("use_cpu") is True:
        device = "cpu"
    sharding = "fsdp" if dist == "FSDP" else ("ddp" if n > 1 or dist.startswith("MULTI") else "none")
    return Target(n, sharding, device)


def target_from_environment(device: str) -> Target:
    """Under `accelerate launch`: the world size and FSDP from the launcher's environment."""
    n = int(os.environ.get("WORLD_SIZE", "1") or 1)
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    return Target(n, "fsdp" if fsdp else ("ddp" if n > 1 else "none"), device)


# ----------------------------------------------------------------------------- the arithmetic


def resolve_precision(precision: str, device: str) -> str:
    return ("bf16" if device == "cuda" else "fp32") if precision == "auto" else precision


def compose(counts: Any, settings: Settings, target: Target, counted_micro_batch: int) -> MemoryPlan:
    """The plan from counts made at `counted_micro_batch` (activations scale with the batch)."""
    n = target.processes if target.sharding == "fsdp" else 1
    t = counts.trained
    scale = settings.micro_batch / counted_micro_batch
    act_full, act_ckpt = counts.saved * scale, counts.checkpointed * scale
    act = act_ckpt if settings.checkpointing else act_full
    scratch = 2 * counts.largest_saved * scale
    parts: dict[str, int] = {}
    for dtype, b in sorted(counts.weight_bytes.items()):
        parts[f"weights {dtype}"] = int(b / n)
    parts["gradients fp32"] = int(4 * t / n)
    parts["optimizer state (AdamW, 2 x fp32)"] = int(8 * t / n)
    parts["optimizer step scratch"] = int(4 * t / n) if target.device == "cuda" else 0
    parts["activations"] = int(act)
    parts["backward scratch"] = int(scratch)
    parts["teacher weights"] = counts.teacher_bytes
    if target.sharding == "ddp":
        parts["DDP gradient buckets"] = 4 * t
    if target.sharding == "fsdp":
        cbytes = dtype_named(settings.precision).bytes
        parts["FSDP gathered blocks"] = (2 * counts.largest_block + counts.outside_blocks) * cbytes \
            + 4 * counts.largest_block
    state = sum(v for k, v in parts.items() if k.startswith(("weights", "optimizer state", "teacher", "DDP", "FSDP")))
    backward = parts["activations"] + parts["backward scratch"]
    step = parts["gradients fp32"] + parts["optimizer step scratch"]
    plan = MemoryPlan(settings, target, counts.params, t, parts, state + max(backward, step))
    plan.activations_other = int(act_full if settings.checkpointing else act_ckpt)
    return plan


def make_plan(hf_config: Any, settings: Settings, target: Target, *, teacher_config: Any = None,
              teacher: dict[str, Any] | None = None, trust_remote_code: bool = False) -> MemoryPlan:
    """Count the model (fake tensors, no weights) and compose the plan."""
    from gqakit.uptrain.memory import count_model

    te = teacher or {}
    counts = count_model(hf_config, trainable=settings.trainable, seq_len=settings.seq_len,
                         micro_batch=settings.micro_batch, precision=settings.precision, teacher_config=teacher_config,
                         temperature=te.get("temperature", 1.0), hidden=te.get("hidden_weight", 0) > 0,
                         layer=te.get("layer_weight", 0) > 0, trust_remote_code=trust_remote_code,
                         lora=settings.lora, lora_targets=settings.lora.targets if settings.lora else ())
    plan = compose(counts, settings, target, settings.micro_batch)
    plan.counts = counts
    return plan


# ----------------------------------------------------------------------------- fitting


def _variants(s: Settings, target: Target) -> list[tuple[list[str], Settings, Target]]:
    """Changes that lower the peak, cheapest first, as override strings and new settings."""
    out: list[tuple[list[str], Settings, Target]] = []
    ckpt = [] if s.checkpointing else [(["train.gradient_checkpointing=true"], replace(s, checkpointing=True))]
    out += [(o, v, target) for o, v in ckpt]
    mbs = []
    mb, ga = s.micro_batch, s.grad_accum
    while mb > 1 and mb % 2 == 0:  # halve the micro-batch, double the accumulation: the same global batch
        mb, ga = mb // 2, ga * 2
        mbs.append((mb, ga))
    for mb, ga in mbs:
        o = [f"train.micro_batch={mb}", f"train.grad_accum={ga}"]
        out.append((o, replace(s, micro_batch=mb, grad_accum=ga), target))
        for oc, vc in ckpt:
            out.append((oc + o, replace(vc, micro_batch=mb, grad_accum=ga), target))
    return out


def suggestions(plan: MemoryPlan, memory: int, *, recount: Any = None, limit: int = 1) -> list[str]:
    """The cheapest changes that bring the peak under `memory`, as text."""
    counts = plan.counts
    found: list[str] = []
    base = plan.settings
    tries: list[tuple[list[str], Any, Settings, Target]] = [(o, counts, v, t) for o, v, t in _variants(base, plan.target)]
    if base.trainable is None and base.lora is None and recount is not None:
        att = recount(ATTENTION)
        s_att = replace(base, trainable=tuple(ATTENTION))
        tries.append((["train.trainable=[self_attn]"], att, s_att, plan.target))
        tries += [(["train.trainable=[self_attn]", *o], att, v, t) for o, v, t in _variants(s_att, plan.target)]
    if plan.target.device == "cuda":
        single = [([], counts, base, plan.target)] + tries
        for n in (2, 4, 8, 16, 32, 64):
            if n > (plan.target.processes if plan.target.sharding == "fsdp" else 1):
                fs = Target(n, "fsdp", "cuda")
                tries += [([f"FSDP on {n} GPUs (configs/accelerate/fsdp.yaml, num_processes={n})", *o], c, v, fs)
                          for o, c, v, _ in single]
    for o, c, v, t in tries:
        p = compose(c, v, t, base.micro_batch)
        if p.peak <= memory:
            found.append(" ".join(o) + f" (peak {gib(p.peak)})")
            if len(found) >= limit:
                break
    return found


# ----------------------------------------------------------------------------- text


def describe(plan: MemoryPlan, name: str, devices: Sequence[tuple[str, int]], fits_with: dict[str, list[str]]) -> list[str]:
    """The plan as lines of text."""
    s, t = plan.settings, plan.target
    how = f" (LoRA r {s.lora.r} on {short_targets(list(s.lora.targets))})" if s.lora else ""
    lines = [f"memory plan per process: {name} ({plan.params / 1e6:,.1f}M params, {plan.trained / 1e6:,.1f}M trained"
             f"{how}), seq_len {s.seq_len} x micro_batch {s.micro_batch}, {s.precision}, {t.describe()}"]
    for k, v in plan.parts.items():
        extra = ""
        if k == "activations":
            extra = (f"   (without gradient_checkpointing: {gib(plan.activations_other)})" if s.checkpointing else
                     f"   (with gradient_checkpointing: {gib(plan.activations_other)})")
        lines.append(f"  {k:<36} {gib(v):>12}{extra}")
    lines.append(f"  {'peak':<36} {gib(plan.peak):>12}")
    for label, mem in devices:
        if plan.peak <= mem:
            lines.append(f"fits {label} ({gib(mem)}), {gib(mem - plan.peak)} to spare")
        else:
            how = fits_with.get(label) or []
            lines.append(f"does not fit {label} ({gib(mem)})" + (f"; fits with {how[0]}" if how else
                                                                "; no change tried here makes it fit"))
    return lines


# ----------------------------------------------------------------------------- entry points


def _settings(cfg: Any, device: str, src: Path) -> Settings:
    t = cfg.train
    lora = None
    if t.lora is not None:
        from gqakit.uptrain.lora import resolve_targets

        lora = LoraPlan(t.lora.r, t.lora.alpha, t.lora.dropout, tuple(resolve_targets(t.lora, src)))
    return Settings(t.seq_len, t.micro_batch, t.grad_accum, t.gradient_checkpointing,
                    tuple(t.trainable) if t.trainable else None, resolve_precision(t.precision, device), lora)


def _configs(cfg: Any, src: Path, teacher_path: Path | None) -> tuple[Any, Any, bool]:
    """The student's and the teacher's transformers configs (config.json only)."""
    from gqakit.core.loading import load_config as load_hf_config, remote_code, split_source

    folder, gguf = split_source(src)
    hf = load_hf_config(src)
    te = cfg.teacher
    uses_teacher = te.kl_weight > 0 or te.hidden_weight > 0 or te.layer_weight > 0
    teacher = load_hf_config(teacher_path) if uses_teacher and teacher_path is not None else None
    return hf, teacher, remote_code(folder, gguf)


def plan_for_config(cfg: Any, *, device_memory: Sequence[str] = (), accelerate_config: str | None = None,
                    src: Path | None = None, teacher: Path | None = None) -> tuple[list[str], bool]:
    """`--dry-run`: the plan's lines and whether it fits one of the devices named (or this
    machine's device when none is named). Reads config.json files only. SRC and TEACHER are
    the model and teacher as preflight resolved them (by default `model.path` and
    `teacher.path` as local paths)."""
    import torch

    from gqakit.core.hub import resolve_model_ref  # a Hub id: its snapshot in the Hugging Face cache

    src = Path(src) if src is not None else resolve_model_ref(cfg.model.path).path
    if teacher is None and cfg.teacher.path:
        teacher = resolve_model_ref(cfg.teacher.path).path

    named = [(f"{m.strip()} device", device_memory_size(m)) for m in device_memory]
    gpu = torch.cuda.is_available() and not cfg.train.cpu
    device = "cuda" if named or gpu else "cpu"
    if accelerate_config:
        target = target_from_accelerate_config(accelerate_config, device)
    else:
        target = target_from_environment(device)
    devices = named
    if not devices:
        devices = [(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)] if gpu \
            else [("host RAM", host_memory())]
    hf, teacher_config, trc = _configs(cfg, src, teacher)
    if getattr(hf, "is_encoder_decoder", False):
        return [f"memory plan: none; it covers decoder-only models, and {src.name} is an "
                f"encoder-decoder ({getattr(hf, 'model_type', '?')})"], True
    settings = _settings(cfg, target.device, src)
    plan = make_plan(hf, settings, target, teacher_config=teacher_config, teacher=cfg.teacher.model_dump(),
                     trust_remote_code=trc)

    def recount(patterns: list[str]) -> Any:
        s = replace(plan.settings, trainable=tuple(patterns))
        return make_plan(hf, s, target, teacher_config=teacher_config, teacher=cfg.teacher.model_dump(),
                         trust_remote_code=trc).counts

    fits_with = {label: suggestions(plan, mem, recount=recount) for label, mem in devices if plan.peak > mem}
    lines = describe(plan, src.name, devices, fits_with)
    fits = any(plan.peak <= mem for _, mem in devices)
    if not fits and not any(fits_with.values()):
        raise GqakitError(f"the plan needs {gib(plan.peak)} per process and fits none of the devices named "
                          f"({', '.join(gib(m) for _, m in devices)}), with no change tried here")
    return lines, fits


def plan_for_run(cfg: Any, src: Path, hf_config: Any, *, processes: int, distributed: str, device: str,
                 precision: str, teacher_config: Any = None) -> tuple[dict[str, Any], str]:
    """The plan of a run that is starting: its log.jsonl row and its line of text. A model
    the fake-tensor count cannot build gets a row saying so; the run goes on."""
    from gqakit.core.loading import remote_code

    sharding = "fsdp" if distributed == "FSDP" else ("ddp" if processes > 1 else "none")
    try:
        s = replace(_settings(cfg, device, Path(src)), precision=precision)
        plan = make_plan(hf_config, s, Target(processes, sharding, device), teacher_config=teacher_config,
                         teacher=cfg.teacher.model_dump(), trust_remote_code=remote_code(Path(src), None))
    except Exception as e:  # noqa: BLE001 - the plan informs; it must not stop a run the loader accepted
        why = first_line(e, 200) if isinstance(e, GqakitError) else type(e).__name__
        return {"step": 0, "memory_plan": None, "memory_plan_error": str(e).splitlines()[0][:200] if str(e) else
                type(e).__name__}, f"memory plan: not available ({why})"
    parts = ", ".join(f"{k} {gib(v)}" for k, v in plan.parts.items() if v)
    return plan.row(), f"memory plan: peak {gib(plan.peak)} per process ({parts})"


def host_memory() -> int:
    """Total host memory in bytes (Linux; a large number where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**50


def log_plan(recipe: Any) -> str:
    """Write the plan of the run `recipe` (an `UptrainRecipe` after setup) as the first row
    of its log; returns the plan's line of text."""
    acc, data = recipe.accelerator, recipe.data
    row, line = plan_for_run(recipe.cfg, recipe.checked.src, data.hf_cfg, processes=acc.num_processes,
                             distributed=acc.distributed_type.value, device=acc.device.type,
                             precision=recipe.precision, teacher_config=getattr(data.teacher, "config", None))
    recipe.log(row)
    return line
