"""Calibrated conversion (`align-refit`), streamed one decoder block at a time.

Memory stays flat in the model's depth, the way GPTQ and llm-compressor's sequential
onloading scale calibration to 70B models on one GPU:

  - the model is built on the meta device (accelerate's `init_empty_weights`); only the
    modules outside the decoder blocks are materialised (the input embedding only for
    the rows the calibration text uses), and the model's own forward computes the first
    block's input together with each block's rotary embeddings and masks;
  - two hidden-state streams for all calibration tokens, the original model's and the
    converted-so-far model's, live on the device, in CPU memory or in files on disk
    (`offload`), in a storage dtype of their own (`stream_dtype`);
  - block L is loaded from the checkpoint onto the device, fitted, advanced on both
    streams, handed to the writer and freed before block L+1 is read.

The fit of one block, from the original stream x and the converted stream x':

  1. moments E[x~ x~^T], E[x~ x~'^T], E[x~' x~'^T] of the attention inputs (normed, with
     a constant 1 appended), accumulated in float64 batch by batch;
  2. grouping (optional, by aligned-weight similarity in the input metric), then
     RoPE-aware alignment in the metric of E[x x^T], then mean pooling;
  3. query refit: per query head, the RoPE-commuting map (scaled 2x2 rotation per
     frequency pair, full matrix on unrotated dims) that best reproduces its original
     keys k_j(x) from the pooled keys k'(x'), by ridge least squares on those moments;
  4. o_proj refit: ridge least squares of o_proj on the converted block's per-head
     attention outputs, towards the original model's residual stream after this
     attention (original attention output + original residual - converted residual), so
     each layer also corrects the drift of the layers before it. Its normal equations
     are accumulated batch by batch in float64, rows weighted by 1/|original residual|^2
     (`row_weight`), so outsized "attention sink" rows do not dominate;
  5. block-wise reconstruction (optional, `steps` > 0; BRECQ / AutoRound style): Adam
     steps on the block's converted q, k, v, o (K/V shared per group, the rest of the
     block frozen) minimising the relative squared error between the block's output on
     the converted stream and the original block's output on the original stream,
     seeded per layer, with a held-out guard that keeps the closed-form fit when the
     steps do not help. With `train` = "block" the steps also train the rest of the
     block (MLP and norms), which the writer then takes from the stage
     (`block_tensors`) instead of copying them from the source.

Options (`refit_options`; Python API and bench --options; every key is checked):
seq_len, batch (sequences per block forward), sample_batch (sequences per generate call
when sampling), q_ridge, o_ridge (ridge strength relative to the mean diagonal of the
normal matrix; < 0 skips that refit), target ("residual" | "local"), skip_first (leave
the first n positions of every sequence out of the fits), row_weight ("relative" |
"none"), holdout (a fraction of the sequences kept out of the fits; the reported
`residual_drift` is then measured on them), dtype (block compute: auto = float64 for
models under 20M parameters on the CPU, else float32), stream_dtype (auto = the compute
dtype), offload (auto | device | cpu | disk), checkpoint_seconds (how often, at most, the
streams and the finished layers are saved so that an interrupted run resumes), steps
(reconstruction steps per layer; 0 = closed-form fits only), lr (Adam's learning rate
relative to each tensor's RMS), guard_spans (batches of sequences the guard measures on),
train ("attention": the steps train q, k, v and o only; "block": every weight of the
block; a Hugging Face folder output only).

Calibration text is `--calibration-data` (a text file or `hf:NAME[:CONFIG][:SPLIT]`,
tokenised and cut into sequences) or, without it, text sampled from the source model,
which needs the whole model in memory once.
"""

from __future__ import annotations

import math
import time
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from gqakit.core import arch as archmod
from gqakit.convert.align import (align_heads, expand_kv, pool_mean, refit_o_proj_moments, refit_queries)
from gqakit.convert.layout import AttnHeads, layer_names, read_heads, write_heads
from gqakit.convert.grouping import GROUPINGS
from gqakit.convert.pooling import regroup
from gqakit.core.device import PeakMemory, available_memory
from gqakit.core.errors import GqakitError
from gqakit.core.tokens import bos_id, sample_tokens

if TYPE_CHECKING:  # the pipeline imports this module when it runs the stage, never the other way
    from gqakit.convert.pipeline import Opened, Plan, Settings

DEFAULTS: dict[str, Any] = {
    "seq_len": 256, "batch": "auto", "sample_batch": 64, "q_ridge": 1e-2, "o_ridge": 3e-2, "target": "residual",
    "skip_first": 0, "row_weight": "relative", "holdout": 0.0, "dtype": "auto", "stream_dtype": "auto",
    "offload": "auto", "checkpoint_seconds": 120.0, "steps": 0, "lr": 1e-2, "guard_spans": 8,
    "train": "attention",
}
CHOICES = {"target": ("residual", "local"), "row_weight": ("relative", "none"),
           "dtype": ("auto", "float32", "float64"),
           "stream_dtype": ("auto", "float32", "float64", "bfloat16", "float16"),
           "offload": ("auto", "device", "cpu", "disk"), "train": ("attention", "block")}
_MIN_INT = {"seq_len": 2, "batch": 1, "sample_batch": 1, "skip_first": 0, "steps": 0, "guard_spans": 1}
SMALL_MODEL = 20_000_000  # parameters: below this, CPU calibration computes in float64


def refit_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """DEFAULTS updated with `options`; an unknown key or a bad value is a one-line error."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise GqakitError(f"unknown align-refit option(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    out = dict(DEFAULTS)
    for key, value in options.items():
        if key in CHOICES:
            if value not in CHOICES[key]:
                raise GqakitError(f"align-refit option {key}={value!r}; choose from {', '.join(CHOICES[key])}")
        elif key == "batch" and value == "auto":
            pass
        elif key in _MIN_INT:
            if isinstance(value, bool) or not isinstance(value, int) or value < _MIN_INT[key]:
                raise GqakitError(f"align-refit option {key} must be an integer >= {_MIN_INT[key]}, got {value!r}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise GqakitError(f"align-refit option {key} must be a finite number, got {value!r}")
            if key == "holdout" and not 0 <= value < 1:
                raise GqakitError(f"align-refit option holdout must be in [0, 1), got {value!r}")
            if key == "lr" and value <= 0:
                raise GqakitError(f"align-refit option lr must be > 0, got {value!r}")
            if key == "checkpoint_seconds" and value < 0:
                raise GqakitError(f"align-refit option checkpoint_seconds must be >= 0, got {value!r}")
        out[key] = value
    return out


def train_steps(opts: dict[str, Any], kv_from: int | None = None, kv_to: int | None = None) -> int:
    """Block-wise reconstruction steps per layer for resolved options `opts` (`refit_options`):
    none when the conversion keeps every K/V head (kv_to >= kv_from: it is exact); with the
    head counts unknown (None), the steps asked for."""
    if kv_from is not None and kv_to is not None and kv_to >= kv_from:
        return 0
    return int(opts["steps"])


def trains_block(opts: dict[str, Any], kv_from: int | None = None, kv_to: int | None = None) -> bool:
    """Whether the steps train every weight of each converted block (`train=block` with steps),
    so that the writer takes the blocks' MLP and norms from the stage, not from the source."""
    return train_steps(opts, kv_from, kv_to) > 0 and opts["train"] == "block"


def describe(calibration: dict[str, Any]) -> str:
    """What `align-refit` did, in one line for the model card (from its calibration record)."""
    opts = calibration.get("options", {})
    parts = ["RoPE-aware alignment of each group's heads in the metric of the layer's input activations, "
             "mean pooling"]
    if float(opts.get("q_ridge", 0)) >= 0:
        parts.append("query refit (per-frequency scaled rotations) by ridge least squares")
    if float(opts.get("o_ridge", 0)) >= 0:
        parts.append(f"o_proj ridge refit towards the original model's {opts.get('target', 'residual')} stream")
    if calibration.get("reconstruction"):
        what = "every weight of the block" if opts.get("train") == "block" else "q, k, v and o"
        parts.append(f"block-wise reconstruction: {int(opts['steps'])} Adam steps per layer on {what} "
                     f"(lr {opts['lr']} x each tensor's RMS, decaying linearly) towards the original block's output; each layer "
                     f"keeps whichever of the closed-form fit and the trained weights had the lower guard loss")
    return "; ".join(parts)


QUALITY_SIGNAL = ("residual drift: the relative distance ‖h' − h‖ / ‖h‖ between the converted and the original "
                  "model's hidden states on calibration text after each layer (0 = identical). It is the "
                  "conversion's own quality signal: the larger the drift after the last layer, the further "
                  "the perplexity before uptraining is from the original's (docs/benchmarks.md pairs them)")


def source_path(opened: Opened) -> Path:
    return Path(opened.folder) / opened.gguf if opened.gguf else Path(opened.folder)


def _bos_id(config: dict[str, Any], tokenizer: Any = None) -> int:
    tid = bos_id(tokenizer, config, eos_fallback=True)
    if tid is None:
        raise GqakitError("cannot build calibration sequences: the model has neither a BOS nor an EOS token; "
                          "pass --calibration-data FILE")
    return tid


def _generation_config(opened: Opened) -> dict[str, Any]:
    import json

    p = Path(opened.folder) / "generation_config.json"
    try:
        return json.loads(p.read_text()) if not opened.gguf and p.is_file() else {}
    except (OSError, ValueError):
        return {}


def calibration_sequences(opened: Opened, data: str | None, tokens: int, seq_len: int, seed: int, *,
                          sample_batch: int = 64, device: str = "cpu", progress: bool = True,
                          source_params: int = 0) -> tuple[Tensor, str]:
    """Token ids [n_seq, seq_len] (each sequence starts with BOS) and where they came from."""
    path = source_path(opened)
    cfg = {**opened.config, **{k: v for k, v in _generation_config(opened).items() if v is not None}}
    max_pos = archmod.max_positions(opened.config)
    seq_len = min(seq_len, max_pos) if max_pos else seq_len
    n_seq = max(1, math.ceil(tokens / seq_len))
    if data:
        from gqakit.core.loading import load_tokenizer
        from gqakit.core.text import read_text

        doc = read_text(str(data))
        tok = load_tokenizer(path)
        ids = tok(doc.text, add_special_tokens=False)["input_ids"]
        bos = _bos_id(cfg, tok)
        body = seq_len - 1
        if len(ids) < body:
            raise GqakitError(f"calibration data {doc.source} has {len(ids)} tokens, fewer than one sequence of "
                              f"{seq_len}")
        n_seq = min(n_seq, len(ids) // body)
        seqs = torch.tensor([[bos] + ids[i * body:(i + 1) * body] for i in range(n_seq)], dtype=torch.long)
        return seqs, f"{doc.source} ({n_seq} x {seq_len} tokens)"
    need = int(source_params * 4 * 1.2)  # float32 weights, plus room to generate
    free = available_memory(device)
    if need > free:
        raise GqakitError(f"sampling calibration text needs the whole model in memory ({need / 1e9:.1f} GB in "
                          f"float32, {free / 1e9:.1f} GB free on {device}); pass --calibration-data FILE "
                          f"(or hf:NAME[:CONFIG][:SPLIT])")
    from gqakit.core.loading import load_causal_lm

    bos = _bos_id(cfg)
    model = load_causal_lm(path, dtype=torch.float32, device=device, progress=progress)
    out = []
    eos = cfg.get("eos_token_id")
    eos = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    with torch.inference_mode(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # seeds the GPU's generator too
        for i in tqdm(range(0, n_seq, sample_batch), desc="sampling calibration text", disable=not progress):
            b = min(sample_batch, n_seq - i)
            # full-length sequences from the model's own distribution: EOS is never drawn
            gen = sample_tokens(model, [bos], b, seq_len - 1, never=eos).cpu()
            out.append(torch.cat([torch.full((b, 1), bos, dtype=torch.long), gen], dim=1))
    del model
    _empty_cache(device)
    return torch.cat(out), f"sampled from the source model ({n_seq} x {seq_len} tokens, seed {seed})"


CHECKPOINT = "checkpoint"


def load_checkpoint(resume_dir: Path | None) -> dict[str, Any] | None:
    """The state an interrupted run saved under `resume_dir` (None when there is none)."""
    if resume_dir is None or not (resume_dir / CHECKPOINT / "state.json").is_file():
        return None
    try:
        return json.loads((resume_dir / CHECKPOINT / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _empty_cache(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    else:
        _trim()


# ----------------------------------------------------------------------------- streams

class Streams:
    """The original and the converted hidden-state streams, [n_seq, T, D] each.

    `where`: "device" (the compute device), "cpu" (host memory) or "disk" (files in
    `folder`, memory-mapped, so the OS pages them in and out).
    """

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, where: str, device: str,
                 folder: Path | None = None) -> None:
        self.where, self.device, self.dtype = where, device, dtype
        numel = shape[0] * shape[1] * shape[2]
        if where == "disk":
            assert folder is not None
            folder.mkdir(parents=True, exist_ok=True)
            self.orig, self.new = (torch.from_file(str(folder / f"{name}.bin"), shared=True, size=numel,
                                                   dtype=dtype).view(shape) for name in ("orig", "new"))
        else:
            dev = device if where == "device" else "cpu"
            self.orig = torch.empty(shape, dtype=dtype, device=dev)
            self.new = torch.empty(shape, dtype=dtype, device=dev)

    @property
    def nbytes(self) -> int:
        return 2 * self.orig.numel() * self.orig.element_size()

    def get(self, which: str, sl: slice, dtype: torch.dtype) -> Tensor:
        return getattr(self, which)[sl].to(device=self.device, dtype=dtype)

    def put(self, which: str, sl: slice, value: Tensor) -> None:
        getattr(self, which)[sl].copy_(value)

    def save(self, folder: Path, chunk: int = 64) -> None:
        """Both streams as raw files `orig.bin`, `new.bin` (a resume checkpoint)."""
        for which in ("orig", "new"):
            t = getattr(self, which)
            with open(folder / f"{which}.bin", "wb") as f:
                for i in range(0, t.shape[0], chunk):
                    f.write(memoryview(t[i:i + chunk].cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))

    def load(self, folder: Path) -> None:
        for which in ("orig", "new"):
            t = getattr(self, which)
            saved = torch.from_file(str(folder / f"{which}.bin"), shared=False, size=t.numel(), dtype=t.dtype)
            t.copy_(saved.view(t.shape))


def choose_offload(want: str, stream_bytes: int, block_bytes: int, device: str) -> str:
    """Where the streams go: the device when they fit next to a few blocks, else host memory, else disk."""
    if want != "auto":
        return want
    if str(device).startswith("cuda") and stream_bytes < 0.7 * (available_memory(device) - 4 * block_bytes):
        return "device"
    return "cpu" if stream_bytes < 0.5 * available_memory("cpu") else "disk"


# ----------------------------------------------------------------------------- the model skeleton

class _Stop(Exception):
    pass


def _split_hidden(args: tuple, kwargs: dict) -> tuple[Tensor, tuple, dict, bool]:
    if args:
        return args[0], args[1:], kwargs, True
    rest = dict(kwargs)
    return rest.pop("hidden_states"), (), rest, False


def _call_block(block: Any, hidden: Tensor, call: tuple[tuple, dict, bool]) -> Tensor:
    args, kwargs, positional = call
    out = block(hidden, *args, **kwargs) if positional else block(*args, hidden_states=hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _set_param(module: Any, name: str, value: Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    mod = module.get_submodule(owner) if owner else module
    setattr(mod, attr, torch.nn.Parameter(value, requires_grad=False))


class Skeleton:
    """The source model on the meta device; materialises one decoder block at a time."""

    def __init__(self, opened: Opened, spec: archmod.ArchSpec, num_layers: int, device: str, dtype: torch.dtype):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        from gqakit.core.loading import load_config

        self.opened, self.source, self.device, self.dtype = opened, opened.source, device, dtype
        config = load_config(source_path(opened))
        with init_empty_weights(include_buffers=False):  # buffers (rotary inv_freq, masks) stay real
            self.model = AutoModelForCausalLM.from_config(config)
        self.model.eval()
        self.block_names = [spec.block_name(L) for L in range(num_layers)]
        self.blocks = [self.model.get_submodule(n) for n in self.block_names]
        self.body = getattr(self.model, "base_model", None) or self.model
        names = set(self.source.names())
        prefix = getattr(self.model, "base_model_prefix", "") + "."
        self._src_name = {}
        for name, _ in self.model.named_parameters():
            if name in names:
                self._src_name[name] = name
            elif name.startswith(prefix) and name[len(prefix):] in names:
                self._src_name[name] = name[len(prefix):]

    def src(self, name: str) -> str:
        if name not in self._src_name:
            raise GqakitError(f"tensor {name} of the {type(self.model).__name__} layout is not in the source checkpoint")
        return self._src_name[name]

    def load_outer(self, token_ids: Tensor) -> Tensor:
        """Materialise everything outside the blocks (not the LM head); the input embedding
        holds only the rows of `token_ids`. Returns the map from token id to its row."""
        emb = self.model.get_input_embeddings()
        out_emb = self.model.get_output_embeddings()
        in_blocks = tuple(n + "." for n in self.block_names)
        used = torch.unique(token_ids)
        for name, p in list(self.model.named_parameters()):
            if name.startswith(in_blocks):
                continue
            if p is emb.weight:
                rows = self.source.rows(self.src(name), used)
                _set_param(self.model, name, rows.to(device=self.device, dtype=self.dtype))
                emb.num_embeddings = rows.shape[0]
            elif out_emb is not None and p is out_emb.weight:
                continue  # logits are never computed
            else:
                _set_param(self.model, name, self.source.get(self.src(name)).to(device=self.device, dtype=self.dtype))
        for mod in self.model.modules():
            for bname, buf in list(mod.named_buffers(recurse=False)):
                if buf.device.type != "meta":
                    mod._buffers[bname] = buf.to(self.device, dtype=self.dtype if buf.is_floating_point() else None)
        remap = torch.full((int(token_ids.max()) + 1,), -1, dtype=torch.long)
        remap[used] = torch.arange(len(used))
        return remap

    def block_inputs(self, ids: Tensor, kwargs_out: dict[int, list]) -> Tensor:
        """Run the model up to the first block on `ids` [B, T]; returns block 0's input.

        The blocks are replaced by pass-throughs for this call, so the model's own code
        computes every block's extra inputs (rotary cos/sin, masks by layer type), which
        are recorded in `kwargs_out[B]` (once per batch size)."""
        B = ids.shape[0]
        record = B not in kwargs_out
        calls: list = []
        first: list[Tensor] = []
        hooks, saved_fwd = [], []

        def pre(mod, args, kwargs, L):
            hidden, rest, kw, positional = _split_hidden(args, kwargs)
            if L == 0:
                first.append(hidden)
            if record:
                calls.append((rest, kw, positional))
            if L == len(self.blocks) - 1:
                raise _Stop

        for L, blk in enumerate(self.blocks):
            hooks.append(blk.register_forward_pre_hook(lambda m, a, k, L=L: pre(m, a, k, L), with_kwargs=True))
            saved_fwd.append(blk.__dict__.get("forward"))
            blk.forward = lambda *a, **k: a[0] if a else k["hidden_states"]
        try:
            with torch.inference_mode():
                self.body(input_ids=ids.to(self.device), use_cache=False)
        except _Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
            for blk, fwd in zip(self.blocks, saved_fwd):
                if fwd is None:
                    del blk.forward
                else:
                    blk.forward = fwd
        if record:
            if len(calls) != len(self.blocks):
                raise GqakitError(f"{type(self.model).__name__}: expected {len(self.blocks)} decoder blocks, "
                                  f"the forward pass called {len(calls)}")
            kwargs_out[B] = calls
        return first[0]

    def load_block(self, L: int) -> Any:
        block = self.blocks[L]
        for rel, _ in list(block.named_parameters()):
            t = self.source.get(self.src(f"{self.block_names[L]}.{rel}"))
            _set_param(block, rel, t.to(device=self.device, dtype=self.dtype))
        for mod in block.modules():
            for bname, buf in list(mod.named_buffers(recurse=False)):
                mod._buffers[bname] = buf.to(self.device, dtype=self.dtype if buf.is_floating_point() else None)
        return block

    def free_block(self, L: int) -> None:
        block = self.blocks[L]
        for rel, p in list(block.named_parameters()):
            _set_param(block, rel, torch.empty(p.shape, dtype=p.dtype, device="meta"))

    def materialised_blocks(self) -> list[int]:
        return [L for L, b in enumerate(self.blocks) if any(p.device.type != "meta" for p in b.parameters())]


# ----------------------------------------------------------------------------- the stage

def _add_moment(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += [a 1]^T [b 1] in place, without building the augmented copies."""
    D = a.shape[1]
    acc[:D, :D].addmm_(a.T, b)
    acc[:D, D] += a.sum(0)
    acc[D, :D] += b.sum(0)
    acc[D, D] += a.shape[0]


def _clone_tree(x: Any) -> Any:
    """Tensors in nested tuples / lists / dicts cloned (inference-mode tensors made usable by autograd)."""
    if isinstance(x, Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone_tree(i) for i in x)
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    return x


def _trim() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise), so RSS tracks use."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Grab:
    """Forward pre-hook (or hook) on a submodule that keeps its input (output) rows."""

    def __init__(self, module: Any, output: bool = False, stop: bool = False):
        self.rows: Tensor | None = None
        self.stop = stop
        self.handle = (module.register_forward_hook(self._out) if output
                       else module.register_forward_pre_hook(self._in))

    def _in(self, mod, args):
        self.rows = args[0].reshape(-1, args[0].shape[-1])
        if self.stop:
            raise _Stop

    def _out(self, mod, args, out):
        self.rows = out.reshape(-1, out.shape[-1])

    def remove(self) -> None:
        self.handle.remove()


class RefitStage:
    """`align-refit`, one block at a time: `layers()` yields (layer, converted heads) in order.

    After the generator is exhausted, `summary` holds the calibration record: where the
    text came from, tokens, per-layer residual drift, device, peak memory and time.
    """

    def __init__(self, opened: Opened, plan: Plan, settings: Settings, *, device: str = "cpu", progress: bool = True,
                 scratch: Path | None = None, resume_dir: Path | None = None,
                 written: Callable[[], list[str]] | None = None):
        """`resume_dir`: where checkpoints go (and are resumed from); `written`: the names of
        the tensors the writer holds, recorded with each checkpoint."""
        self.opened, self.plan, self.settings, self.device = opened, plan, settings, device
        self.progress, self.scratch = progress, scratch
        self.resume_dir, self.written = resume_dir, written
        self.opts = refit_options(settings.options)
        self.spec = archmod.registry()[plan.family]
        if self.opts["dtype"] == "auto":
            small = plan.source_params < SMALL_MODEL and device == "cpu"
            self.dtype = torch.float64 if small else torch.float32
        else:
            self.dtype = getattr(torch, self.opts["dtype"])
        # sequences per block forward: 4 on the CPU, 8 on a GPU (2,048 tokens: enough to keep
        # it busy, while the float64 temporaries of the fits stay small next to the streams)
        b = self.opts["batch"]
        self.batch = int(b) if b != "auto" else (8 if str(device).startswith("cuda") else 4)
        sd = self.opts["stream_dtype"]
        self.stream_dtype = self.dtype if sd == "auto" else getattr(torch, sd)
        self.summary: dict[str, Any] = {}
        self.skeleton: Skeleton | None = None
        # block-wise reconstruction steps per layer; none at G = KV heads (the conversion is exact)
        self.train_steps = train_steps(self.opts, plan.shape.num_kv_heads, settings.num_kv_heads)
        self.recon: list[dict[str, Any]] = []
        self.train_block = trains_block(self.opts, plan.shape.num_kv_heads, settings.num_kv_heads)
        self._block_out: dict[int, dict[str, Tensor]] = {}  # trained non-attention tensors, by layer

    # ------------------------------------------------------------------ the stage, block by block

    def layers(self) -> Iterator[tuple[int, AttnHeads]]:
        t0 = time.perf_counter()
        peak = PeakMemory(self.device)
        peak.reset()
        start = self._prepare()
        L_n = self.plan.shape.num_layers
        per_layer = len(self.spans) * 3 + self.train_steps
        self.bar = tqdm(total=L_n * per_layer, initial=start * per_layer, desc="calibrating",
                        unit="batch", disable=not self.progress, dynamic_ncols=True)
        last_checkpoint = time.perf_counter()
        for L in range(start, L_n):
            tl = time.perf_counter()
            self.bar.set_description(f"calibrating layer {L + 1}/{L_n}")
            blk = _Block(self, L)
            whiten, s_on, s_nn = self._input_moments(blk)
            blk.free()  # the CPU fits do not need it: back to meta, read again after
            pooled = self._fit_heads(blk, whiten, s_on, s_nn)
            del whiten, s_on, s_nn
            _trim()
            blk.load()
            pooled, converted = self._fit_o_proj(blk, pooled)
            if self.train_steps:
                pooled, converted = self._reconstruct(blk, pooled)
                if self.train_block:
                    self._block_out[L] = blk.trained_rest()
            self._advance_converted(blk, converted)
            del converted  # the block's weights now: freed with it
            blk.free()
            secs = time.perf_counter() - tl
            self.bar.set_postfix_str(f"{self.tokens / secs:,.0f} tok/s"
                                     + (f", drift {self.drift[-1]:.3f}" if self.drift else ""))
            yield L, pooled
            if (self.resume_dir is not None and L + 1 < L_n
                    and time.perf_counter() - last_checkpoint >= float(self.opts["checkpoint_seconds"])):
                self._checkpoint(L + 1)
                last_checkpoint = time.perf_counter()
        self.bar.close()
        self.summary = {
            "calibration": self.where, "calibration_sequences": self.seqs.shape[0], "seq_len": self.seqs.shape[1],
            "tokens": self.tokens, "device": self.device, "compute_dtype": str(self.dtype).replace("torch.", ""),
            "stream_dtype": str(self.stream_dtype).replace("torch.", ""), "streams_on": self.streams.where,
            "stream_bytes": self.streams.nbytes, "batch": self.batch, "options": self.opts,
            "residual_drift": self.drift, "residual_drift_first": self.drift_first,
            "peak_memory_bytes": peak.peak(), "seconds": round(time.perf_counter() - t0, 3),
            "resumed_at_layer": start if self.resumed else None,
        }
        if self.train_steps:
            self.summary["reconstruction"] = self.recon

    def block_tensors(self, L: int) -> dict[str, Tensor]:
        """The trained non-attention tensors of layer L by source name (`train` = "block"),
        on the CPU; each is handed over once, after layer L is yielded."""
        return self._block_out.pop(L, {})

    def _prepare(self) -> int:
        """Calibration tokens, the skeleton, every block's extra inputs and the two streams
        (from a checkpoint when resuming). Returns the first layer to fit."""
        L_n = self.plan.shape.num_layers
        state = load_checkpoint(self.resume_dir)
        self.resumed = state is not None
        if state is not None:
            assert self.resume_dir is not None
            self.seqs, self.where = torch.load(self.resume_dir / CHECKPOINT / "seqs.pt"), state["where"]
            start, self.drift, self.drift_first = state["layers_done"], state["drift"], state["drift_first"]
        else:
            self.seqs, self.where = calibration_sequences(
                self.opened, self.settings.calibration_data, self.settings.calibration_tokens,
                int(self.opts["seq_len"]), self.settings.seed, sample_batch=int(self.opts["sample_batch"]),
                device=self.device, progress=self.progress, source_params=self.plan.source_params)
            start, self.drift, self.drift_first = 0, [], []
        n_seq, T = self.seqs.shape
        self.tokens = n_seq * T
        sk = self.skeleton = Skeleton(self.opened, self.spec, L_n, self.device, self.dtype)
        remap = sk.load_outer(self.seqs)
        self.spans = [slice(i, min(i + self.batch, n_seq)) for i in range(0, n_seq, self.batch)]
        self.calls: dict[int, list] = {}
        streams: Streams | None = None
        for sl in self.spans:
            if state is not None and (sl.stop - sl.start) in self.calls:
                continue  # resuming: the streams come from the checkpoint, only the block inputs are needed
            h = sk.block_inputs(remap[self.seqs[sl]], self.calls)
            if streams is None:
                self.hidden = h.shape[-1]
                per_block = self.plan.source_params // max(L_n, 1) * self.dtype.itemsize
                nbytes = 2 * n_seq * T * self.hidden * self.stream_dtype.itemsize
                place = choose_offload(self.opts["offload"], nbytes, per_block, self.device)
                streams = Streams((n_seq, T, self.hidden), self.stream_dtype, place, self.device,
                                  (self.scratch / "calibration-streams") if self.scratch else None)
            if state is None:
                streams.put("orig", sl, h)
                streams.put("new", sl, h)
        assert streams is not None
        self.streams = streams
        if state is not None:
            assert self.resume_dir is not None
            streams.load(self.resume_dir / CHECKPOINT)
        return start

    def _masks(self, sl: slice) -> tuple[Tensor, Tensor, Tensor]:
        """Rows of span `sl`: those that enter the fits, those the drift is measured on, and
        the first positions of the measured sequences (see `holdout`, `skip_first`)."""
        n_seq, T = self.seqs.shape
        n_hold = min(n_seq - 1, int(round(float(self.opts["holdout"]) * n_seq)))
        seq = torch.arange(sl.start, sl.stop, device=self.device).repeat_interleave(T)
        p = torch.arange(T, device=self.device).repeat(sl.stop - sl.start)
        held = seq >= n_seq - n_hold
        skip = p >= int(self.opts["skip_first"])
        measure = (skip & held) if n_hold else skip
        first = (p == 0) & held if n_hold else (p == 0)
        return skip & ~held, measure, first

    def _input_moments(self, blk: "_Block") -> tuple[Tensor, Tensor, Tensor]:
        """1. float64 moments of the attention inputs [x 1] of both streams, batch by batch:
        (Cholesky factor of E[x~ x~^T], E[x~ x~'^T], E[x~' x~'^T]), on the CPU."""
        D, f64 = self.hidden, torch.float64
        s_oo = torch.zeros(D + 1, D + 1, dtype=f64, device=self.device)
        s_on, s_nn = torch.zeros_like(s_oo), torch.zeros_like(s_oo)
        n_rows = 0
        g = _Grab(blk.q_in, stop=True)
        with torch.inference_mode():
            try:
                for sl in self.spans:
                    keep = self._masks(sl)[0]
                    blk.run(sl, "orig")
                    xo = g.rows[keep].to(f64)
                    blk.run(sl, "new")
                    xn = g.rows[keep].to(f64)
                    _add_moment(s_oo, xo, xo)
                    _add_moment(s_on, xo, xn)
                    _add_moment(s_nn, xn, xn)
                    n_rows += xo.shape[0]
                    del xo, xn
                    self.bar.update(1)
            finally:
                g.remove()
        if n_rows == 0:
            raise GqakitError("no calibration rows left for the fits: lower skip_first or holdout, or pass "
                              "more --calibration-tokens")
        for m in (s_oo, s_on, s_nn):
            m /= n_rows
        s_oo, s_on, s_nn = s_oo.cpu(), s_on.cpu(), s_nn.cpu()
        s_oo.diagonal().add_(1e-8 * float(torch.diagonal(s_oo).mean()))
        return torch.linalg.cholesky(s_oo), s_on, s_nn

    def _fit_heads(self, blk: "_Block", whiten: Tensor, s_on: Tensor, s_nn: Tensor) -> AttnHeads:
        """2.-3. grouping, alignment, pooling and the query refit, on the CPU in float64."""
        spec, shape, G, L = self.spec, self.plan.shape, self.settings.num_kv_heads, blk.L
        src_t = {n: self.opened.source.get(self.skeleton.src(n)) for n in blk.attn_rel}
        heads = read_heads(spec, shape, src_t, L, dtype=torch.float64)
        h = regroup(heads, GROUPINGS[self.settings.grouping](heads, G, rotary_style=spec.rotary.style,
                                                              rotary_dim=shape.rotary_dim, whiten=whiten))
        al = align_heads(h, G, rotary_style=spec.rotary.style, rotary_dim=shape.rotary_dim, whiten=whiten)
        del heads, h, src_t
        pooled = pool_mean(al, G)
        if float(self.opts["q_ridge"]) >= 0:
            pooled = refit_queries(al, pooled, rotary_style=spec.rotary.style, rotary_dim=shape.rotary_dim,
                                   s_ab=s_on, s_bb=s_nn, ridge=float(self.opts["q_ridge"]))
        return pooled

    def _fit_o_proj(self, blk: "_Block", pooled: AttnHeads) -> tuple[AttnHeads, dict[str, Tensor]]:
        """4. o_proj's float64 normal equations on the converted block, towards the original
        residual stream after attention; advances the original stream one block on the way.
        Returns the final heads and their block weights."""
        D, f64, opts = self.hidden, torch.float64, self.opts
        converted = blk.weights(pooled)
        fit_o = float(opts["o_ridge"]) >= 0
        H_D = pooled.o.shape[1] * pooled.o.shape[2]
        zz = torch.zeros(H_D, H_D, dtype=f64, device=self.device) if fit_o else None
        zt = torch.zeros(H_D, pooled.o.shape[0], dtype=f64, device=self.device) if fit_o else None
        o_bias = blk.o_bias()
        with torch.inference_mode():
            for sl in self.spans:
                keep = self._masks(sl)[0]
                blk.use(blk.original)
                ro = self.streams.get("orig", sl, self.dtype)
                grab_out = _Grab(blk.o_mod, output=True)
                try:
                    ro_next = blk.run(sl, ro)
                finally:
                    grab_out.remove()
                if fit_o:
                    out_o = grab_out.rows[keep].to(f64)
                    ro_rows = ro.reshape(-1, D)[keep].to(f64)
                    target = out_o
                    if opts["target"] == "residual":
                        rn_rows = self.streams.get("new", sl, self.dtype).reshape(-1, D)[keep].to(f64)
                        target = target + (ro_rows - rn_rows)
                    if opts["row_weight"] == "relative":
                        post = ro_rows + out_o
                        w = (1.0 / post.pow(2).mean(dim=1).clamp_min(1e-30)).sqrt().unsqueeze(1)
                    else:
                        w = torch.ones(out_o.shape[0], 1, dtype=f64, device=self.device)
                    if o_bias is not None:
                        target = target - o_bias
                    blk.use(converted)
                    g = _Grab(blk.o_mod, stop=True)
                    try:
                        blk.run(sl, "new")
                    finally:
                        g.remove()
                    z = g.rows[keep].to(f64) * w
                    zz.addmm_(z.T, z)
                    zt.addmm_(z.T, target * w)
                    del z, target, w
                self.streams.put("orig", sl, ro_next)
                self.bar.update(1)
        if fit_o:
            pooled = pooled.replace(o=refit_o_proj_moments(zz.cpu(), zt.cpu(), pooled.o, float(opts["o_ridge"])))
            converted = blk.weights(pooled)
        return pooled, converted

    def _reconstruct(self, blk: "_Block", pooled: AttnHeads) -> tuple[AttnHeads, dict[str, Tensor]]:
        """4b. block-wise reconstruction (BRECQ / AutoRound style): `steps` Adam steps on the
        converted block's attention weights (q, k, v, o and their biases; K/V shared by each
        group, everything else in the block frozen), minimising the relative squared error
        between the block's output on the converted stream and the original block's output
        on the original stream (which `_fit_o_proj` has just advanced), one random span of
        `batch` sequences per step. Each tensor's learning rate is `lr` times its RMS, decaying
        linearly to 0 over the steps. The
        steps are seeded by (seed, layer), so a resumed run takes the same ones. A guard
        keeps the best of the closed-form start and the weights after each quarter of the
        steps, by the loss on the last `guard_spans` spans' measured rows (the held-out
        sequences when `holdout` > 0)."""
        opts, L = self.opts, blk.L
        steps = int(opts["steps"])
        parts = [p for p in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias") if getattr(pooled, p) is not None]
        params = {p: getattr(pooled, p).detach().to(device=self.device, dtype=self.dtype).clone().requires_grad_()
                  for p in parts}
        rest = blk.rest_names() if self.train_block else []
        for r in rest:  # the block's other weights, by their name in the block ("mlp.up_proj.weight")
            params[r] = blk.block.get_parameter(r).detach().to(self.dtype).clone().requires_grad_()
        groups = [{"params": [t], "lr": float(opts["lr"]) * max(float(t.detach().pow(2).mean().sqrt()), 1e-12)}
                  for t in params.values()]
        optim = torch.optim.Adam(groups)
        # the learning rate decays linearly to zero over the steps (as AutoRound's does)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda i: 1.0 - i / steps)
        dtypes = {n: self.dtype for n in blk.attn_rel}
        calls: dict[int, tuple] = {}

        def call_of(B: int) -> tuple:
            # the recorded block inputs were made under inference mode: clone them for autograd
            if B not in calls:
                args, kwargs, positional = self.calls[B][L]
                calls[B] = (_clone_tree(args), _clone_tree(kwargs), positional)
            return calls[B]

        def loss_on(sl: slice, mask: Tensor, current: dict[str, Tensor]) -> Tensor:
            heads = pooled.replace(**{p: current[p] for p in parts})
            w = write_heads(self.spec, expand_kv(heads, self.plan.shape.num_kv_heads), L, dtypes)
            args, kwargs, positional = call_of(sl.stop - sl.start)
            x = self.streams.get("new", sl, self.dtype)
            if positional:
                a, k = (x, *args), kwargs
            else:
                a, k = (), {**kwargs, "hidden_states": x}
            weights = {blk.attn_rel[n]: t for n, t in w.items()} | {r: current[r] for r in rest}
            out = torch.func.functional_call(blk.block, weights, a, k)
            out = (out[0] if isinstance(out, tuple) else out).reshape(-1, self.hidden)[mask]
            y = self.streams.get("orig", sl, self.dtype).reshape(-1, self.hidden)[mask]
            return ((out - y).pow(2).sum(1) / y.pow(2).sum(1).clamp_min(1e-30)).mean()

        fit = [sl for sl in self.spans if bool(self._masks(sl)[0].any())]
        guard = [(sl, self._masks(sl)[1]) for sl in self.spans[-int(opts["guard_spans"]):]]
        guard = [(sl, m) for sl, m in guard if bool(m.any())]

        def guard_loss() -> float:
            with torch.no_grad():
                cur = {p: t.detach() for p, t in params.items()}
                return sum(float(loss_on(sl, m, cur)) for sl, m in guard) / max(len(guard), 1)

        best, best_at = guard_loss(), 0
        best_params = {p: t.detach().clone() for p, t in params.items()}
        gen = torch.Generator().manual_seed(int(self.settings.seed) * 1_000_003 + L)
        check = max(1, steps // 4)
        for step in range(1, steps + 1):
            sl = fit[int(torch.randint(len(fit), (1,), generator=gen))]
            with torch.enable_grad():
                loss = loss_on(sl, self._masks(sl)[0], params)
                optim.zero_grad(set_to_none=True)
                loss.backward()
            optim.step()
            sched.step()
            self.bar.update(1)
            if step % check == 0 or step == steps:
                g = guard_loss()
                if g < best:
                    best, best_at = g, step
                    best_params = {p: t.detach().clone() for p, t in params.items()}
                self.bar.set_postfix_str(f"reconstruction loss {float(loss.detach()):.4f}, guard {g:.4f}")
        self.recon.append({"layer": L, "guard_best": best, "best_step": best_at})
        del optim, sched, params, calls
        for r in rest:  # the block keeps its trained weights for the converted stream and the writer
            blk.block.get_parameter(r).data = best_params.pop(r)
        pooled = pooled.replace(**{p: t.to(getattr(pooled, p).dtype).cpu() for p, t in best_params.items()})
        return pooled, blk.weights(pooled)

    def _advance_converted(self, blk: "_Block", converted: dict[str, Tensor]) -> None:
        """5. the converted stream advanced one block; its drift from the original one recorded."""
        D, f64 = self.hidden, torch.float64
        last = blk.L + 1 == self.plan.shape.num_layers
        blk.use(converted)
        blk.original = None
        _trim()
        err = torch.zeros(2, dtype=f64, device=self.device)
        cnt = torch.zeros(2, dtype=f64, device=self.device)
        with torch.inference_mode():
            for sl in self.spans:
                rn_next = blk.run(sl, "new")
                self.streams.put("new", sl, rn_next)
                if not last:
                    _, measure, first = self._masks(sl)
                    ro = self.streams.get("orig", sl, self.dtype).reshape(-1, D)
                    rel = ((rn_next.reshape(-1, D) - ro).norm(dim=1).to(f64)
                           / ro.norm(dim=1).to(f64).clamp_min(1e-30))
                    err += torch.stack([rel[measure].sum(), rel[first].sum()])
                    cnt += torch.stack([measure.sum(), first.sum()]).to(f64)
                self.bar.update(1)
        if not last:
            e = (err / cnt.clamp_min(1)).tolist()
            self.drift.append(e[0])
            self.drift_first.append(e[1])

    def _checkpoint(self, layers_done: int) -> None:
        """Save what a resumed run needs, atomically: a kill during the save keeps the last one."""
        assert self.resume_dir is not None
        tmp, final = self.resume_dir / (CHECKPOINT + ".tmp"), self.resume_dir / CHECKPOINT
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(self.seqs, tmp / "seqs.pt")
        self.streams.save(tmp)
        state = {"layers_done": layers_done, "where": self.where, "drift": self.drift,
                 "drift_first": self.drift_first, "written": self.written() if self.written else []}
        (tmp / "state.json").write_text(json.dumps(state) + "\n")
        old = self.resume_dir / (CHECKPOINT + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)


class _Block:
    """Decoder block L of the stage's skeleton: loaded on the device or freed, its attention
    weights swappable between the original and a converted set, run on a span of a stream."""

    def __init__(self, stage: RefitStage, L: int):
        self.stage, self.L = stage, L
        sk, a = stage.skeleton, stage.spec.attention
        assert sk is not None
        self.prefix = sk.block_names[L] + "."
        attn = a.prefix.format(layer=L)
        self.q_name = (attn + (a.q or a.qkv))[len(self.prefix):]
        self.o_name = (attn + a.o)[len(self.prefix):]
        self.names = layer_names(stage.spec, L)
        on_meta = dict(sk.blocks[L].named_parameters())
        self.attn_rel = {n: n[len(self.prefix):] for n in self.names.values() if n[len(self.prefix):] in on_meta}
        self.original: dict[str, Tensor] | None = None
        self.load()

    def load(self) -> None:
        self.block = self.stage.skeleton.load_block(self.L)
        params = dict(self.block.named_parameters())
        self.original = {n: params[r].data for n, r in self.attn_rel.items()}

    def free(self) -> None:
        self.original = None
        self.stage.skeleton.free_block(self.L)
        _empty_cache(self.stage.device)

    def rest_names(self) -> list[str]:
        """The block's parameters outside its attention projections (MLP, norms), block-relative."""
        attn = set(self.attn_rel.values())
        return [r for r, _ in self.block.named_parameters() if r not in attn]

    def trained_rest(self) -> dict[str, Tensor]:
        """`rest_names`' current values by source tensor name, on the CPU."""
        sk = self.stage.skeleton
        return {sk.src(self.prefix + r): self.block.get_parameter(r).detach().cpu() for r in self.rest_names()}

    @property
    def q_in(self) -> Any:
        return self.block.get_submodule(self.q_name)

    @property
    def o_mod(self) -> Any:
        return self.block.get_submodule(self.o_name)

    def o_bias(self) -> Tensor | None:
        rel = (self.names["o.weight"][: -len("weight")] + "bias")[len(self.prefix):]
        params = dict(self.block.named_parameters())
        return params[rel].data.to(torch.float64) if rel in params else None

    def weights(self, heads: AttnHeads) -> dict[str, Tensor]:
        """`heads` as this block's attention tensors (K/V repeated back to the block's head count)."""
        st = self.stage
        out = write_heads(st.spec, expand_kv(heads, st.plan.shape.num_kv_heads), self.L,
                          {n: st.dtype for n in self.attn_rel})
        return {n: t.to(st.device) for n, t in out.items()}

    def use(self, weights: dict[str, Tensor]) -> None:
        cur = dict(self.block.named_parameters())
        for n, r in self.attn_rel.items():
            cur[r].data = weights[n]

    def run(self, sl: slice, x: Tensor | str) -> Tensor | None:
        """The block on span `sl` of a stream (by name) or on `x`; None when a hook stopped it."""
        st = self.stage
        if isinstance(x, str):
            x = st.streams.get(x, sl, st.dtype)
        try:
            return _call_block(self.block, x, st.calls[sl.stop - sl.start][self.L])
        except _Stop:
            return None
