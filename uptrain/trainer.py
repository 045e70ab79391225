"""The uptraining loop: one readable pass over optimizer steps on 🤗 accelerate.

Read top to bottom: `run_uptrain` checks the inputs (`preflight`), then `UptrainRecipe`
runs in three steps, as a torchtune recipe does: `setup` (load and check, then open the
run folder, prepare, restore when resuming), `train` (`train_step` until the token
budget is spent, evaluating, logging and checkpointing on the way) and `save` (export an
HF folder). The loss terms live in `losses.py`, checkpoints and the NaN checks in
`checkpoint.py`.

The same code runs on CPU (tests), one GPU, or many processes through
`accelerate launch` (DDP or FSDP chosen by the accelerate config, not by this file).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from gqakit.core.errors import GqakitError, Interrupted
from gqakit.core.loading import (UPTRAIN_SETTINGS, load_causal_lm, load_config as load_hf_config, load_seq2seq_lm,
                                 load_tokenizer)
from gqakit.core.outdir import describe_oserror, make_dirs, remove_if_empty
from gqakit.core.outrule import MANIFEST, RUN, RUN_ENTRIES, check_output_path, why_not_ours, write_manifest
from gqakit.uptrain.checkpoint import CKPT_DIR, Diverged, checkpoints, last_good, nonfinite, restore, save_checkpoint
from gqakit.uptrain.config import UptrainConfig, to_yaml
from gqakit.uptrain.data import BlockOrder, build_blocks
from gqakit.uptrain.losses import LOSS_TERMS, batch_losses, evaluate, loss_card, loss_log, objective, predicted_tokens
from gqakit.uptrain.memory import set_trainable
from gqakit.uptrain.plan import log_plan
from gqakit.uptrain.preflight import Checked, preflight, same_tokenizer
from gqakit.uptrain.schedule import lr_at, resolve_warmup, total_steps

LOG_FILE = "log.jsonl"
MODEL_DIR = "model"

# Dense bf16 peak FLOP/s per device, for MFU (H100/H200 SXM; A100; L4; A10G).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def train_step(accelerator: Any, model: Any, optimizer: Any, micro: list[Any], teacher: Any | None,
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
    n_tok = accelerator.reduce(torch.tensor(sum(predicted_tokens(x) for x in micro), device=dev), "sum")
    # DDP/FSDP average gradients over processes and accelerator.backward divides by
    # grad_accum; multiplying by both undoes that averaging.
    scale = accelerator.num_processes * t.grad_accum / n_tok.item()
    sums = torch.zeros(len(LOSS_TERMS), device=dev, dtype=torch.float64)
    for x in micro:
        with accelerator.accumulate(model):  # gradients are synchronised at the step's last micro-batch
            with accelerator.autocast():
                ls = batch_losses(model, x, teacher, cfg)
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
    if nonfinite(accelerator, (p for p in model.parameters() if p.requires_grad)):
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
    train_blocks: Any  # [N, seq_len] token blocks; an encoder-decoder's `seq2seq.SpanExamples` / `PairedExamples`
    eval_blocks: Any | None
    data_sha: str
    model: Any
    teacher: Any | None
    lora_targets: list[str] | None  # the adapted projections with train.lora, else None


def _load(checked: Checked, accelerator: Any, precision: str, quiet: bool) -> _Loaded:
    """Model, tokenizer, teacher and data: everything is loaded and checked before the run
    folder is touched (an --overwrite deletes the old run only after this)."""
    from accelerate.utils import set_seed

    cfg, src, t = checked.cfg, checked.src, checked.cfg.train
    hf_cfg = load_hf_config(src)
    tokenizer = load_tokenizer(src)
    teacher_path = checked.teacher
    if teacher_path is not None:
        if not same_tokenizer(tokenizer, load_tokenizer(teacher_path)):
            raise GqakitError(f"teacher.path: the tokenizer of {teacher_path} differs from the model's")

    set_seed(t.seed)
    where = {"files": checked.files, "eval_files": checked.eval_files, "main_first": accelerator.main_process_first,
             "is_main": accelerator.is_main_process, "progress": not quiet}
    seq2seq = cfg.data.objective != "causal_lm"  # preflight resolved "auto"
    if seq2seq:  # span corruption or paired rows, for an encoder-decoder
        from gqakit.uptrain.seq2seq import build_examples

        train_blocks, eval_blocks = build_examples(cfg.data, tokenizer, hf_cfg, t.seq_len, t.seed, **where)
        data_sha = train_blocks.fingerprint()
    else:
        train_blocks, eval_blocks = build_blocks(cfg.data, tokenizer, t.seq_len, teacher_path=teacher_path, **where)
        data_sha = hashlib.sha256(train_blocks.contiguous().numpy().data).hexdigest()  # no copy of the blocks
    load = load_seq2seq_lm if seq2seq else load_causal_lm
    if checked.mode == "resume":
        old = (checked.resume_state.get("data") or {}).get("sha256")
        if old is not None and old != data_sha:
            raise GqakitError("--resume: the training data differ from this run's (data.files or their content "
                              f"changed; token fingerprint {old[:12]} -> {data_sha[:12]}); the data order would "
                              "differ: restore the data, or start a new run")
    model = load(src)  # fp32 master weights; autocast handles bf16
    model.config.use_cache = False
    if t.trainable:
        # Conversion only touched attention: training just those weights keeps the rest
        # of the original network exact instead of letting it drift on limited data.
        set_trainable(model, t.trainable, precision)  # frozen weights in the compute dtype
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    lora_targets = None
    if t.lora is not None:  # adapters on the converted projections; the base frozen in the compute dtype
        from gqakit.uptrain.lora import apply_lora

        model, lora_targets = apply_lora(model, t, src, precision)
    teacher = None
    use_hidden, use_layer = cfg.teacher.hidden_weight > 0, cfg.teacher.layer_weight > 0
    if cfg.teacher.kl_weight > 0 or use_hidden or use_layer:
        teacher = load(teacher_path, device=accelerator.device)
        if (use_hidden or use_layer) and (teacher.config.num_hidden_layers, teacher.config.hidden_size) != (
                hf_cfg.num_hidden_layers, hf_cfg.hidden_size):
            raise GqakitError(f"teacher.{'hidden' if use_hidden else 'layer'}_weight: the teacher's layers or hidden size differ from the model's")
        teacher.requires_grad_(False)
    return _Loaded(tokenizer, hf_cfg, train_blocks, eval_blocks, data_sha, model, teacher, lora_targets)


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


def _make_optimizer(model: Any, t: Any) -> torch.optim.Optimizer:
    """AdamW; as in nanoGPT, matrices decay and biases and norms do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=False)


def _run(checked: Checked, quiet: bool) -> Path:
    """The recipe: set up, train, save. A new run that fails before its first checkpoint
    leaves nothing behind."""
    recipe = UptrainRecipe(checked, quiet)
    try:
        recipe.setup()
        recipe.train()
        return recipe.save()
    except BaseException:
        recipe.discard_if_unfinished()
        raise


class UptrainRecipe:
    """One run, in three steps (torchtune's recipe shape):

    - `setup`: load and check the model, teacher and data, compute the step budget, and
      only then replace or create the run folder; prepare model and optimizer, print the
      plan, restore the checkpoint of a resumed run;
    - `train`: optimizer steps until the token budget is spent, logging, evaluating and
      checkpointing on the way;
    - `save`: the final held-out loss and the exported model folder.
    """

    def __init__(self, checked: Checked, quiet: bool):
        self.checked, self.quiet = checked, quiet
        self.cfg, self.out = checked.cfg, checked.out
        self.made: list[Path] | None = None  # set once the run folder exists
        self.step, self.loss, self.eval_loss = 0, float("nan"), None

    def say(self, msg: str) -> None:
        if not self.quiet:
            self.accelerator.print(msg)

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        checked, t = self.checked, self.cfg.train
        self.accelerator, self.precision, self.use_tb = _make_accelerator(self.cfg, self.out)
        acc = self.accelerator
        self.data = _load(checked, acc, self.precision, self.quiet)
        self.order = BlockOrder(len(self.data.train_blocks), seed=t.seed, micro=t.micro_batch, accum=t.grad_accum,
                                world=acc.num_processes, rank=acc.process_index)
        self.tokens_per_step = self.order.global_batch * t.seq_len
        self.total_steps = total_steps(t, self.tokens_per_step)

        # ---- every check has passed: only now is the run folder replaced or created
        self.made = _prepare_run_folder(checked) if acc.is_main_process else []
        acc.wait_for_everyone()

        model = self.data.model
        if t.compile:
            model = torch.compile(model)
        self.model, self.optimizer = acc.prepare(model, _make_optimizer(model, t))
        self.model.train()
        self.warmup, scaled = resolve_warmup(t, self.total_steps)
        self._print_plan()
        if scaled:
            self.say("uptrain: " + scaled)
        if checked.mode == "resume":
            restore(acc, self.out, checked.resume_step)
            self.step, self.loss = checked.resume_state["step"], checked.resume_state.get("loss", float("nan"))
            self.say(f"uptrain: resumed from {self.out / CKPT_DIR / f'step-{checked.resume_step}'} at step {self.step}")
        self.log = RunLog(acc, self.out / LOG_FILE, checked.resume_step)
        if checked.mode != "resume":  # the predicted peak, first in the log (`--dry-run` prints the same plan)
            self.say("uptrain: " + log_plan(self))

    def _print_plan(self) -> None:
        """The plan, printed before the first step (and the tensorboard tracker started)."""
        acc, t, hf_cfg, world = self.accelerator, self.cfg.train, self.data.hf_cfg, self.accelerator.num_processes
        params = list(acc.unwrap_model(self.model).parameters())
        n_params, n_train = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
        self.flops_per_token = 6 * n_params + 12 * hf_cfg.num_hidden_layers * hf_cfg.hidden_size * t.seq_len
        self.peak = peak_flops(acc.device)
        dist = acc.distributed_type.value
        self.say(f"uptrain: {self.checked.src.name} ({n_params / 1e6:.2f}M params, {n_train / 1e6:.2f}M trained, "
                 f"{hf_cfg.num_attention_heads} query / {getattr(hf_cfg, 'num_key_value_heads', '?')} KV heads) on "
                 f"{world} x {acc.device.type}" + (f" ({dist})" if dist != "NO" else "") + f", {self.precision}")
        what = "blocks of" if self.cfg.data.objective == "causal_lm" else f"{self.cfg.data.objective} examples, input"
        self.say(f"uptrain: {len(self.data.train_blocks)} training {what} {t.seq_len} tokens; "
                 f"{self.tokens_per_step:,} tokens per optimizer step ({t.micro_batch} x {t.grad_accum} accum x "
                 f"{world} proc x {t.seq_len}); {self.total_steps} steps = "
                 f"{self.total_steps * self.tokens_per_step:,} planned tokens "
                 f"({self.order.epochs(self.total_steps):.2f} epochs)")
        if self.use_tb:
            acc.init_trackers("uptrain", config={f"{s}.{k}": v for s, sec in self.cfg.model_dump().items()
                                                 if isinstance(sec, dict) for k, v in sec.items()
                                                 if isinstance(v, (int, float, str, bool))})
            self.say(f"uptrain: tensorboard logs in {self.out / 'uptrain'} (tensorboard --logdir {self.out})")

    # ------------------------------------------------------------------ train

    def _evaluate_and_log(self) -> float:
        """Held-out loss now, in log.jsonl."""
        t = self.cfg.train
        el = evaluate(self.accelerator, self.model, self.data.eval_blocks, self.cfg.eval.micro_batch or t.micro_batch)
        self.log({"step": self.step, "tokens": self.step * self.tokens_per_step, "eval_loss": el,
                  "eval_ppl": math.exp(el)})
        return el

    def _micro_batch(self, accum_index: int) -> Any:
        """This process's micro-batch `accum_index` of the current step, on its device."""
        blocks, ids = self.data.train_blocks, self.order.indices(self.step, accum_index)
        if isinstance(blocks, torch.Tensor):
            return blocks[ids].to(self.accelerator.device)
        return blocks.batch(ids, self.order.samples(self.step, accum_index)).to(self.accelerator.device)

    def _diverged(self, what: str) -> Diverged:
        return Diverged(f"training diverged at step {self.step + 1}: {what}; stopped before it reached a checkpoint "
                        f"({last_good(self.out)}); lower train.lr?")

    def train(self) -> None:
        from tqdm.auto import tqdm

        acc, cfg, t, out = self.accelerator, self.cfg, self.cfg.train, self.out
        teacher, eval_blocks = self.data.teacher, self.data.eval_blocks
        is_main, world = acc.is_main_process, acc.num_processes
        if eval_blocks is not None and self.step == 0:
            self.eval_loss = self._evaluate_and_log()
            self.say(f"uptrain: step 0 held-out perplexity {math.exp(self.eval_loss):.3f}")

        bar = tqdm(total=self.total_steps, initial=self.step, desc="uptrain", unit="step",
                   disable=not is_main or self.quiet, dynamic_ncols=True)
        t0, tokens_since = time.perf_counter(), 0
        data_state = {"files": [str(f) for f in self.checked.files], "sha256": self.data.data_sha}
        try:
            while self.step < self.total_steps:
                lr = lr_at(self.step, cfg.train, self.total_steps, self.warmup)
                for g in self.optimizer.param_groups:
                    g["lr"] = lr
                micro = [self._micro_batch(a) for a in range(t.grad_accum)]
                means, grad_norm = train_step(acc, self.model, self.optimizer, micro, teacher, cfg, self._diverged)
                self.loss = means["ce"]
                self.step += 1
                step = self.step
                tokens_since += self.tokens_per_step
                bar.update(1)

                if step % cfg.logging.every == 0 or step == self.total_steps:
                    tps = tokens_since / (time.perf_counter() - t0)
                    row = {"step": step, "tokens": step * self.tokens_per_step,
                           **loss_log(means, cfg, teacher is not None), "lr": lr, "tok_per_s": round(tps, 1)}
                    if grad_norm is not None:
                        row["grad_norm"] = float(grad_norm)
                    if self.peak:
                        row["mfu"] = round(tps * self.flops_per_token / (self.peak * world), 4)
                    self.log(row)
                    bar.set_postfix(loss=f"{self.loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}",
                                    **({"mfu": f"{row['mfu']:.1%}"} if self.peak else {}))
                    t0, tokens_since = time.perf_counter(), 0
                if eval_blocks is not None and cfg.eval.every and (step % cfg.eval.every == 0
                                                                   or step == self.total_steps):
                    self.eval_loss = self._evaluate_and_log()
                    if is_main and not self.quiet:
                        bar.write(f"step {step}: held-out perplexity {math.exp(self.eval_loss):.3f}")
                if cfg.output.save_every and (step % cfg.output.save_every == 0 or step == self.total_steps):
                    save_checkpoint(acc, out, step, {"step": step, "tokens": step * self.tokens_per_step,
                                                     "loss": self.loss, "data": data_state},
                                    cfg.output.keep_last, model=self.model, optimizer=self.optimizer)
        except KeyboardInterrupt:
            bar.close()
            last = checkpoints(out)
            if last:
                where = f"resume from {last[-1][1].name} with: {self.checked.resume_command()}"
            else:
                where = ("no checkpoint was saved yet, so nothing was kept (set output.save_every to keep one); "
                         "start again")
            raise Interrupted(f"uptrain stopped at step {self.step} of {self.total_steps}; {where}") from None
        bar.close()

    # ------------------------------------------------------------------ save

    def save(self) -> Path:
        """The final held-out loss, then the model folder `output.dir/model`."""
        acc, cfg, out, teacher = self.accelerator, self.cfg, self.out, self.data.teacher
        if self.data.eval_blocks is not None and (not cfg.eval.every or self.eval_loss is None):
            self.eval_loss = self._evaluate_and_log()
        # gather the full state dict on every process (FSDP needs all of them)
        state_dict = acc.get_state_dict(self.model)
        final = out / MODEL_DIR
        if acc.is_main_process:
            from gqakit.uptrain.export import export_model

            model, lora_card = acc.unwrap_model(self.model), {}
            if cfg.train.lora is not None:  # the adapters merged: a plain model that loads without peft
                from gqakit.uptrain.lora import merged_model

                model, state_dict, lora_card = merged_model(model, state_dict, cfg.train.lora, self.data.lora_targets)
            step, loss, eval_loss = self.step, self.loss, self.eval_loss
            ppl = f"{math.exp(eval_loss):.3f}" if eval_loss is not None else "n/a"
            facts = {"tokens": f"{step * self.tokens_per_step:,}", "optimizer steps": step,
                     "tokens per step": f"{self.tokens_per_step:,}", "final train loss": f"{loss:.4f}",
                     "held-out loss": f"{eval_loss:.4f}" if eval_loss is not None else "n/a",
                     "held-out perplexity": ppl, **loss_card(cfg, teacher is not None),
                     "processes": acc.num_processes, "precision": self.precision, **lora_card}
            export_model(model, state_dict, self.data.tokenizer, src=self.checked.src,
                         out=final, settings=cfg.model_dump(mode="json"), facts=facts)
            self.say(f"uptrain: final loss {loss:.4f}" + (f", held-out perplexity {ppl}" if eval_loss is not None
                                                          else "") + f"; model in {final}")
        acc.wait_for_everyone()
        acc.end_training()
        return final

    # ------------------------------------------------------------------ failure

    def discard_if_unfinished(self) -> None:
        """A new run that failed before its first checkpoint leaves nothing, so the corrected
        run starts like the first. Only what the output rule says gqakit wrote is removed: a
        run folder that has gained a file of the user's is left whole."""
        if self.made is None or not self.accelerator.is_main_process:
            return
        out = self.out
        try:
            self.accelerator.end_training()  # closes the tensorboard files
        except Exception:  # the run is failing already; its own error is the one to report
            pass
        if self.checked.mode == "resume" or checkpoints(out) or (out / MODEL_DIR).exists():
            return
        if not out.is_dir() or why_not_ours(out, RUN) is not None:
            return
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        remove_if_empty(self.made)
