"""The uptraining loop: one readable pass over optimizer steps on 🤗 accelerate.

Read top to bottom: `run_uptrain` checks the inputs (`preflight`), then `_run` is the
recipe: set up (`_make_accelerator`, `_load`, `_prepare_run_folder`, `_make_optimizer`,
`_restore` when resuming), `train_step` until the token budget is spent, evaluating and
checkpointing on the way, and finally export an HF folder. The loss terms live in
`losses.py`.

The same code runs on CPU (tests), one GPU, or many processes through
`accelerate launch` (DDP or FSDP chosen by the accelerate config, not by this file).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from gqakit.core.errors import GqakitError, Interrupted
from gqakit.core.loading import UPTRAIN_SETTINGS, load_causal_lm, load_config as load_hf_config, load_tokenizer
from gqakit.core.outdir import (MANIFEST, RUN, RUN_ENTRIES, check_output_path, describe_oserror, make_dirs,
                                remove_if_empty, why_not_ours, write_manifest)
from gqakit.uptrain.config import UptrainConfig, to_yaml
from gqakit.uptrain.data import BlockOrder, build_blocks
from gqakit.uptrain.losses import LOSS_TERMS, loss_card, loss_log, objective, token_losses
from gqakit.uptrain.preflight import (CKPT_DIR, RESUME_KEYS, STATE_FILE, Checked, checkpoint_files,  # noqa: F401
                                      checkpoints, damaged_message, preflight)

LOG_FILE = "log.jsonl"
MODEL_DIR = "model"

# Dense bf16 peak FLOP/s per device, for MFU (H100/H200 SXM; A100; L4; A10G).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12, "4090": 165e12}


def _same_tokenizer(a: Any, b: Any) -> bool:
    return a.get_vocab() == b.get_vocab() and (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id)


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def lr_at(step: int, cfg: UptrainConfig, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio (nanoGPT's schedule)."""
    t = cfg.train
    if step < warmup:
        return t.lr * (step + 1) / (warmup + 1)
    if t.decay == "constant" or total <= warmup:
        return t.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(accelerator: Any, model: Any, blocks: torch.Tensor, micro: int) -> float:
    """Held-out loss per token over packed blocks, split across processes."""
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    # Every process runs the same number of forwards (FSDP needs it); padding rows weigh 0.
    per_rank = math.ceil(len(blocks) / world)
    mine = list(range(rank * per_rank, min(len(blocks), (rank + 1) * per_rank)))
    mine_padded = mine + [0] * (per_rank - len(mine))
    nll = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for i in range(0, per_rank, micro):
        idx = mine_padded[i:i + micro]
        real = sum(1 for j in range(i, i + len(idx)) if j < len(mine))
        x = blocks[idx].to(accelerator.device)
        logits = model(input_ids=x).logits[:, :-1].float()
        per_tok = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        nll[0] += per_tok[:real].sum().double()
        nll[1] += per_tok[:real].numel()
    nll = accelerator.reduce(nll, "sum")
    model.train()
    return float(nll[0] / nll[1])


def train_step(accelerator: Any, model: Any, optimizer: Any, micro: list[torch.Tensor], teacher: Any | None,
               cfg: UptrainConfig, diverged: Callable[[str], Exception]) -> tuple[dict[str, float], Any]:
    """One optimizer step over the micro-batches `micro` of this process: a backward per
    micro-batch, then the optimizer step. Returns the step's per-token mean of each loss
    term (over every process) and the gradient norm; raises `diverged(what)` on NaN/inf.

    All micro-batches of the step are known up front, so the global count of predicted
    tokens is known before the first backward: each micro-batch's summed loss is divided
    by it, and the step's gradient is that of the mean over all tokens of the step (not a
    mean of per-micro-batch means).
    """
    t, dev = cfg.train, accelerator.device
    n_tok = accelerator.reduce(torch.tensor(sum(x[:, 1:].numel() for x in micro), device=dev), "sum")
    # DDP/FSDP average gradients over processes and accelerator.backward divides by
    # grad_accum; multiplying by both undoes that averaging.
    scale = accelerator.num_processes * t.grad_accum / n_tok.item()
    hidden, layer = cfg.teacher.hidden_weight > 0, cfg.teacher.layer_weight > 0
    sums = torch.zeros(len(LOSS_TERMS), device=dev, dtype=torch.float64)
    for x in micro:
        with accelerator.accumulate(model):  # gradients are synchronised at the step's last micro-batch
            with accelerator.autocast():
                ls = token_losses(model, x, teacher, cfg.teacher.temperature, hidden=hidden, layer=layer)
                obj = objective(ls, cfg)
            accelerator.backward(obj * scale)
        sums += torch.stack([getattr(ls, term.field).detach() for term in LOSS_TERMS]).double()
    assert accelerator.sync_gradients, "a step is grad_accum micro-batches: the last one synchronises"

    sums = accelerator.reduce(sums, "sum") / n_tok.double()
    means = {term.field: float(v) for term, v in zip(LOSS_TERMS, sums)}
    if not all(math.isfinite(v) for v in means.values()):
        raise diverged("the loss is NaN/inf")
    # A finite loss can still have a non-finite gradient or update: check both before the
    # step is accepted. (fp16's loss scaler skips such steps itself.)
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))
    if accelerator.scaler is None and not math.isfinite(float(grad_norm)):
        raise diverged("the gradient norm is NaN/inf")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if _nonfinite(accelerator, (p for p in model.parameters() if p.requires_grad)):
        raise diverged("the update made weights NaN/inf")
    return means, grad_norm


def _step_of(row: str) -> float:
    """The step of a log.jsonl row; a damaged row counts as after every checkpoint (dropped)."""
    try:
        r = json.loads(row)
        return r.get("step", 0) if isinstance(r, dict) and isinstance(r.get("step", 0), int) else math.inf
    except ValueError:
        return math.inf


class RunLog:
    """log.jsonl (always) plus accelerate trackers (tensorboard when installed)."""

    def __init__(self, accelerator: Any, path: Path, resume_step: int | None):
        self.acc, self.path = accelerator, path
        if accelerator.is_main_process and resume_step is not None and path.is_file():
            # Drop rows the killed run wrote after its last checkpoint: they will be redone.
            rows = [r for r in path.read_text(errors="replace").splitlines() if _step_of(r) <= resume_step]
            path.write_text("".join(r + "\n" for r in rows))

    def __call__(self, row: dict[str, Any]) -> None:
        if self.acc.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if self.acc.trackers:
            self.acc.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}, step=row["step"])


class Diverged(GqakitError):
    """Training produced NaN/inf: stopped before the bad values reach a checkpoint."""


def _nonfinite(accelerator: Any, tensors: Iterable[torch.Tensor]) -> bool:
    """True when any tensor on any process holds NaN or inf."""
    dev = accelerator.device
    # (optimizer state mixes devices: AdamW keeps its step counters on the CPU)
    # (FSDP2 shards are DTensors: each process checks its local shard, the reduce sums up)
    local = [x.to_local() if hasattr(x, "to_local") else x for x in tensors]
    flags = [torch.isfinite(x).all().to(dev) for x in local if x.is_floating_point() and x.numel()]
    bad = (~torch.stack(flags).all()).float() if flags else torch.zeros((), device=dev)
    return bool(accelerator.reduce(bad.to(accelerator.device).reshape(1), "sum").item() > 0)


def _optimizer_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                yield v


def _last_good(out: Path) -> str:
    last = checkpoints(out)
    return f"the last good checkpoint is {last[-1][1]}" if last else "no checkpoint was saved yet"


def _write_failed(e: BaseException, path: Path) -> GqakitError:
    if isinstance(e, OSError):
        return GqakitError(describe_oserror(e, path))
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return GqakitError(f"could not write {path} (disk full or over quota?): {first}")


def save_checkpoint(accelerator: Any, out: Path, step: int, state: dict[str, Any], keep_last: int,
                    model: Any = None, optimizer: Any = None) -> None:
    """accelerate.save_state into a temp folder, renamed when complete (SIGKILL-safe).

    Never writes non-finite values: the weights and the optimizer state are checked first.
    The sha256 of every file goes into trainer_state.json, so `--resume` can tell a damaged
    checkpoint from a whole one. A failed write (disk full, quota) removes the temp folder
    and becomes one line naming the path.
    """
    final = out / CKPT_DIR / f"step-{step}"
    tmp = out / CKPT_DIR / f".step-{step}.tmp"
    if model is not None and _nonfinite(accelerator, [*model.parameters(), *_optimizer_tensors(optimizer)]):
        raise Diverged(f"the state at step {step} holds NaN/inf values; not saved; {_last_good(out)}; lower train.lr?")
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
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
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


def run_uptrain(config: str | Path | Mapping[str, Any], overrides: Sequence[str] = (), *,
                overwrite: bool = False, resume: bool = False, quiet: bool = False) -> Path:
    """Uptrain a converted model; returns the final model folder (`output.dir/model`)."""
    checked = preflight(config, overrides, overwrite=overwrite, resume=resume)
    return run_checked(checked, quiet=quiet)


def run_checked(checked: Checked, *, quiet: bool = False) -> Path:
    """The run itself, after `preflight`: load, check what needs torch, then write."""
    from gqakit.core.quiet import quiet_libraries

    with quiet_libraries(quiet):
        return _run(checked, quiet)


def _make_accelerator(cfg: UptrainConfig, out: Path) -> tuple[Any, str, bool]:
    """The accelerator, the resolved precision, and whether tensorboard logs."""
    from accelerate import Accelerator
    from accelerate.utils import is_tensorboard_available

    t = cfg.train
    precision = t.precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and not t.cpu and torch.cuda.is_bf16_supported() else "fp32"
    use_tb = cfg.logging.tensorboard and bool(is_tensorboard_available())
    # No GPU: force accelerate's CPU path, so a torchrun/`accelerate launch --multi_gpu`
    # start on a CPU-only machine uses gloo instead of failing on NCCL.
    accelerator = Accelerator(mixed_precision={"fp32": "no"}.get(precision, precision),
                              cpu=t.cpu or not torch.cuda.is_available(),
                              gradient_accumulation_steps=t.grad_accum,
                              log_with="tensorboard" if use_tb else None, project_dir=str(out))
    return accelerator, precision, use_tb


class _Loaded(NamedTuple):
    tokenizer: Any
    hf_cfg: Any
    train_blocks: torch.Tensor
    eval_blocks: torch.Tensor | None
    data_sha: str
    model: Any
    teacher: Any | None


def _load(checked: Checked, accelerator: Any, quiet: bool) -> _Loaded:
    """Model, tokenizer, teacher and data: everything is loaded and checked before the run
    folder is touched (an --overwrite deletes the old run only after this)."""
    from accelerate.utils import set_seed

    cfg, src, t = checked.cfg, checked.src, checked.cfg.train
    hf_cfg = load_hf_config(src)
    tokenizer = load_tokenizer(src)
    teacher_path = checked.teacher
    if teacher_path is not None:
        if not _same_tokenizer(tokenizer, load_tokenizer(teacher_path)):
            raise GqakitError(f"teacher.path: the tokenizer of {teacher_path} differs from the model's")

    set_seed(t.seed)
    train_blocks, eval_blocks = build_blocks(cfg.data, tokenizer, t.seq_len, teacher_path=teacher_path,
                                             main_first=accelerator.main_process_first,
                                             is_main=accelerator.is_main_process, progress=not quiet)
    data_sha = hashlib.sha256(train_blocks.contiguous().numpy().data).hexdigest()  # no copy of the blocks
    if checked.mode == "resume":
        old = (checked.resume_state.get("data") or {}).get("sha256")
        if old is not None and old != data_sha:
            raise GqakitError("--resume: the training data differ from this run's (data.files or their content "
                              f"changed; token fingerprint {old[:12]} -> {data_sha[:12]}); the data order would "
                              "differ: restore the data, or start a new run")
    model = load_causal_lm(src)  # fp32 master weights; autocast handles bf16
    model.config.use_cache = False
    if t.trainable:
        import re

        # Conversion only touched attention: training just those weights keeps the rest
        # of the original network exact instead of letting it drift on limited data.
        for name, p in model.named_parameters():
            p.requires_grad_(any(re.search(pat, name) for pat in t.trainable))
        if not any(p.requires_grad for p in model.parameters()):
            raise GqakitError(f"train.trainable: no parameter name matches {t.trainable}")
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    teacher = None
    use_hidden, use_layer = cfg.teacher.hidden_weight > 0, cfg.teacher.layer_weight > 0
    if cfg.teacher.kl_weight > 0 or use_hidden or use_layer:
        teacher = load_causal_lm(teacher_path, device=accelerator.device)
        if (use_hidden or use_layer) and (teacher.config.num_hidden_layers, teacher.config.hidden_size) != (
                hf_cfg.num_hidden_layers, hf_cfg.hidden_size):
            raise GqakitError(f"teacher.{'hidden' if use_hidden else 'layer'}_weight: the teacher's layers or hidden size differ from the model's")
        teacher.requires_grad_(False)
    return _Loaded(tokenizer, hf_cfg, train_blocks, eval_blocks, data_sha, model, teacher)


def _prepare_run_folder(checked: Checked) -> list[Path]:
    """Every check has passed: only now is the run folder replaced or created (main
    process). Returns the folders this made (removed again if the run fails early)."""
    cfg, src, out = checked.cfg, checked.src, checked.out
    if checked.mode == "overwrite":
        # check again right before deleting: the folder may have changed since preflight
        check_output_path(out, overwrite=True, inputs=[("model.path", src)], kind=RUN, flag="output.dir")
        shutil.rmtree(out)
    made: list[Path] = []
    try:
        made = make_dirs(out)
        if checked.mode != "resume" or not (out / MANIFEST).is_file():
            write_manifest(out, RUN, RUN_ENTRIES)
        (out / UPTRAIN_SETTINGS).write_text(to_yaml(cfg))
    except OSError as e:
        (out / MANIFEST).unlink(missing_ok=True) if checked.mode != "resume" else None
        remove_if_empty(made)
        raise GqakitError(describe_oserror(e, out)) from None
    return made


def _discard_unfinished(accelerator: Any, checked: Checked, made: list[Path]) -> None:
    """A new run that failed before its first checkpoint leaves nothing, so the corrected
    run starts like the first. Only what the output rule says gqakit wrote is removed: a
    run folder that has gained a file of the user's is left whole."""
    out = checked.out
    try:
        accelerator.end_training()  # closes the tensorboard files
    except Exception:  # the run is failing already; its own error is the one to report
        pass
    if checked.mode == "resume" or checkpoints(out) or (out / MODEL_DIR).exists():
        return
    if not out.is_dir() or why_not_ours(out, RUN) is not None:
        return
    for child in out.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    remove_if_empty(made)


def _make_optimizer(model: Any, t: Any) -> torch.optim.Optimizer:
    """AdamW; as in nanoGPT, matrices decay and biases and norms do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=False)


def _restore(checked: Checked, accelerator: Any) -> tuple[int, float]:
    """Weights, optimizer and RNG streams of the checkpoint a resumed run continues from;
    its step and its last loss (the loss to report until a new step is taken)."""
    ckpt = checked.out / CKPT_DIR / f"step-{checked.resume_step}"
    try:
        accelerator.load_state(str(ckpt))
    except Exception as e:  # accelerate and torch raise many types for a file they cannot read
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise GqakitError(damaged_message(ckpt, f"it does not load: {first}", checked.out)) from None
    return checked.resume_state["step"], checked.resume_state.get("loss", float("nan"))


def _run(checked: Checked, quiet: bool) -> Path:
    """The recipe: set up, train step by step (evaluating, logging and checkpointing on the
    way), evaluate, export."""
    from tqdm.auto import tqdm

    cfg, src, out = checked.cfg, checked.src, checked.out
    t = cfg.train
    accelerator, precision, use_tb = _make_accelerator(cfg, out)
    say = accelerator.print if not quiet else (lambda *a, **k: None)
    is_main = accelerator.is_main_process
    tokenizer, hf_cfg, train_blocks, eval_blocks, data_sha, model, teacher = _load(checked, accelerator, quiet)

    world = accelerator.num_processes
    order = BlockOrder(len(train_blocks), seed=t.seed, micro=t.micro_batch, accum=t.grad_accum,
                       world=world, rank=accelerator.process_index)
    tokens_per_step = order.global_batch * t.seq_len
    total_steps = t.budget() // tokens_per_step
    if total_steps < 1:
        raise GqakitError(f"train.tokens: {t.budget()} is less than one optimizer step ({tokens_per_step} tokens)")

    # ---- every check has passed: only now is the run folder replaced or created
    made = _prepare_run_folder(checked) if is_main else []
    accelerator.wait_for_everyone()
    try:
        if t.compile:
            model = torch.compile(model)
        model, optimizer = accelerator.prepare(model, _make_optimizer(model, t))
        model.train()

        # ---- the plan, printed before the first step
        warmup = t.warmup_steps if t.warmup_steps is not None else int(t.warmup_ratio * total_steps)
        n_params = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
        n_train = sum(p.numel() for p in accelerator.unwrap_model(model).parameters() if p.requires_grad)
        flops_per_token = 6 * n_params + 12 * hf_cfg.num_hidden_layers * hf_cfg.hidden_size * t.seq_len
        peak = _peak_flops(accelerator.device)
        dist = accelerator.distributed_type.value
        say(f"uptrain: {src.name} ({n_params / 1e6:.2f}M params, {n_train / 1e6:.2f}M trained, {hf_cfg.num_attention_heads} query / "
            f"{getattr(hf_cfg, 'num_key_value_heads', '?')} KV heads) on {world} x {accelerator.device.type}"
            + (f" ({dist})" if dist != "NO" else "") + f", {precision}")
        say(f"uptrain: {len(train_blocks)} training blocks of {t.seq_len} tokens; "
            f"{tokens_per_step:,} tokens per optimizer step ({t.micro_batch} x {t.grad_accum} accum x {world} proc x {t.seq_len}); "
            f"{total_steps} steps = {total_steps * tokens_per_step:,} planned tokens ({order.epochs(total_steps):.2f} epochs)")
        if use_tb:
            accelerator.init_trackers("uptrain", config={f"{s}.{k}": v for s, sec in cfg.model_dump().items()
                                                         if isinstance(sec, dict) for k, v in sec.items()
                                                         if isinstance(v, (int, float, str, bool))})
            say(f"uptrain: tensorboard logs in {out / 'uptrain'} (tensorboard --logdir {out})")

        step, loss = 0, float("nan")
        if checked.mode == "resume":
            step, loss = _restore(checked, accelerator)
            say(f"uptrain: resumed from {out / CKPT_DIR / f'step-{checked.resume_step}'} at step {step}")
        log = RunLog(accelerator, out / LOG_FILE, checked.resume_step)

        def evaluate_and_log() -> float:
            """Held-out loss now, in log.jsonl."""
            el = evaluate(accelerator, model, eval_blocks, cfg.eval.micro_batch or t.micro_batch)
            log({"step": step, "tokens": step * tokens_per_step, "eval_loss": el, "eval_ppl": math.exp(el)})
            return el

        eval_loss = None
        if eval_blocks is not None and step == 0:
            eval_loss = evaluate_and_log()
            say(f"uptrain: step 0 held-out perplexity {math.exp(eval_loss):.3f}")

        bar = tqdm(total=total_steps, initial=step, desc="uptrain", unit="step", disable=not is_main or quiet, dynamic_ncols=True)
        t0, tokens_since = time.perf_counter(), 0
        data_state = {"files": [str(f) for f in checked.files], "sha256": data_sha}

        def diverged(what: str) -> Diverged:
            return Diverged(f"training diverged at step {step + 1}: {what}; stopped before it reached a checkpoint "
                            f"({_last_good(out)}); lower train.lr?")

        try:
            while step < total_steps:
                lr = lr_at(step, cfg, total_steps, warmup)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                micro = [train_blocks[order.indices(step, a)].to(accelerator.device) for a in range(t.grad_accum)]
                means, grad_norm = train_step(accelerator, model, optimizer, micro, teacher, cfg, diverged)
                loss = means["ce"]
                step += 1
                tokens_since += tokens_per_step
                bar.update(1)

                if step % cfg.logging.every == 0 or step == total_steps:
                    dt = time.perf_counter() - t0
                    tps = tokens_since / dt
                    row = {"step": step, "tokens": step * tokens_per_step, **loss_log(means, cfg, teacher is not None),
                           "lr": lr, "tok_per_s": round(tps, 1)}
                    if grad_norm is not None:
                        row["grad_norm"] = float(grad_norm)
                    if peak:
                        row["mfu"] = round(tps * flops_per_token / (peak * world), 4)
                    log(row)
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", **({"mfu": f"{row['mfu']:.1%}"} if peak else {}))
                    t0, tokens_since = time.perf_counter(), 0
                if eval_blocks is not None and cfg.eval.every and (step % cfg.eval.every == 0 or step == total_steps):
                    eval_loss = evaluate_and_log()
                    bar.write(f"step {step}: held-out perplexity {math.exp(eval_loss):.3f}") if is_main and not quiet else None
                if cfg.output.save_every and (step % cfg.output.save_every == 0 or step == total_steps):
                    save_checkpoint(accelerator, out, step, {"step": step, "tokens": step * tokens_per_step, "loss": loss,
                                                             "data": data_state},
                                    cfg.output.keep_last, model=model, optimizer=optimizer)
        except KeyboardInterrupt:
            bar.close()
            last = checkpoints(out)
            if last:
                where = f"resume from {last[-1][1].name} with: {checked.resume_command()}"
            else:
                where = ("no checkpoint was saved yet, so nothing was kept (set output.save_every to keep one); "
                         "start again")
            raise Interrupted(f"uptrain stopped at step {step} of {total_steps}; {where}") from None
        bar.close()

        if eval_blocks is not None and (not cfg.eval.every or eval_loss is None):
            eval_loss = evaluate_and_log()

        # ---- export: gather the full state dict on every process (FSDP needs all of them)
        state_dict = accelerator.get_state_dict(model)
        final = out / MODEL_DIR
        if is_main:
            from gqakit.uptrain.export import export_model

            facts = {"tokens": f"{step * tokens_per_step:,}", "optimizer steps": step,
                     "tokens per step": f"{tokens_per_step:,}", "final train loss": f"{loss:.4f}",
                     "held-out perplexity": f"{math.exp(eval_loss):.3f}" if eval_loss is not None else "n/a",
                     **loss_card(cfg, teacher is not None), "processes": world, "precision": precision}
            export_model(accelerator.unwrap_model(model), state_dict, tokenizer, src=src, out=final,
                         settings=cfg.model_dump(mode="json"), facts=facts)
            say(f"uptrain: final loss {loss:.4f}"
                + (f", held-out perplexity {math.exp(eval_loss):.3f}" if eval_loss is not None else "") + f"; model in {final}")
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return final
    except BaseException:
        if is_main:  # a new run that fails before its first checkpoint leaves nothing
            _discard_unfinished(accelerator, checked, made)
        raise
