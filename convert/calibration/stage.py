"""The calibration stage: a calibrated conversion, streamed one decoder block at a time.

Memory stays flat in the model's depth, the way GPTQ and llm-compressor's sequential
onloading scale calibration to 70B models on one GPU:

  - the model is built on the meta device (`skeleton.Skeleton`); only the modules outside
    the decoder blocks are materialised, and the model's own forward computes the first
    block's input together with each block's rotary embeddings and masks;
  - two hidden-state streams for all calibration tokens, the original model's and the
    converted-so-far model's, live on the device, in CPU memory or in files on disk
    (`streams.Streams`, `offload`), in a storage dtype of their own (`stream_dtype`);
  - block L is loaded from the source model onto the device, handed to the fit (a `Fit`,
    `block.py`: `refit.AlignRefit` for align-refit), advanced on both streams, its drift
    measured, handed to the writer and freed before block L+1 is read;
  - after a layer, at most every `save_seconds`, the streams, the calibration tokens
    and the names of the tensors written so far are saved as the resume state (`resume.py`),
    so that a killed run resumes after the last one saved.

The stage walks and caches; the fit fits. A second calibrated method is a new `Fit`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from gqakit.convert.calibration.block import Block, BlockContext, Fit
from gqakit.convert.calibration.estimate import PROBE_STEPS, duration, early_line
from gqakit.convert.calibration.fits import fit_for
from gqakit.convert.calibration.memory import trim
from gqakit.convert.calibration.resume import STATE, load_state, load_tokens, save_state
from gqakit.convert.calibration.skeleton import Skeleton
from gqakit.convert.calibration.streams import Streams
from gqakit.convert.calibration.tokens import calibration_sequences, span_rows
from gqakit.convert.layout import AttnHeads
from gqakit.convert.plan import Plan
from gqakit.convert.resolved import ResolvedSettings
from gqakit.convert.source import Opened
from gqakit.core import arch as archmod
from gqakit.core.device import PeakMemory
from gqakit.core.run import show_bars


# The block passes (the fits' moments, the o_proj fit, the streams' advance) run consecutive
# spans together up to this many tokens: on the CPU, a 512-token span's matrix products keep
# two cores less busy than two spans' (SmolLM2's block forward: 21 ms per sequence alone, 17.5
# ms in pairs). The steps still take one span each.
PASS_TOKENS = 1024


def pass_size(batch: int, seq_len: int) -> int:
    """Spans a block pass runs at once: as many as fit in `PASS_TOKENS` (at least one)."""
    return max(1, PASS_TOKENS // (batch * seq_len))


def pass_groups(spans: list[slice], batch: int, seq_len: int) -> list[slice]:
    """Consecutive spans in groups of `pass_size`, each group as one slice of the sequences."""
    n = pass_size(batch, seq_len)
    return [slice(spans[i].start, spans[min(i + n, len(spans)) - 1].stop) for i in range(0, len(spans), n)]


def expected_time(elapsed: float, layer_seconds: float, layers_left: int, layers: int,
                  left_units: float | None = None) -> str:
    """The progress line after the first layer: the expected time of the whole calibration, from
    the time so far and the first layer's seconds times the layers still to do; `left_units`:
    those layers' progress units over the first one's, where the layers differ (a per-layer
    plan's kept layers take no steps)."""
    share = layers_left if left_units is None else left_units
    left = layer_seconds * share
    scaled = "" if left_units is None else ", scaled by each layer's steps"
    return (f"expected time: about {duration(elapsed + left)} in all, {duration(left)} left "
            f"({duration(layer_seconds)} per layer, measured on the first{scaled}; {layers_left} of {layers} layers "
            f"to go)")


class CalibrationStage:
    """A calibrated method, one block at a time: `layers()` yields (layer, converted heads) in order.

    After the generator is exhausted, `summary` holds the calibration record: where the
    text came from, tokens, per-layer residual drift, device, peak memory and time.
    """

    def __init__(self, opened: Opened, plan: Plan, settings: ResolvedSettings, fit: Fit | None = None, *,
                 device: str = "cpu", progress: bool | None = None, scratch: Path | None = None,
                 resume_dir: Path | None = None, written: Callable[[], list[str]] | None = None):
        """`fit`: the method's fit (default: the one `settings.method` names); `resume_dir`: where
        the resume state goes (and is resumed from); `written`: the names of the tensors the
        writer holds, recorded with each save."""
        self.opened, self.plan, self.settings, self.device = opened, plan, settings, device
        self.progress, self.scratch = show_bars(progress), scratch  # None: as the run context says
        self.resume_dir, self.written = resume_dir, written
        self.opts = settings.options
        self.spec = archmod.registry()[plan.family]
        # every setting decided for this model and device (`refit_options.resolve_align_refit`)
        self.dtype = getattr(torch, self.opts.weights_dtype)
        self.batch = int(self.opts.batch)
        self.stream_dtype = getattr(torch, self.opts.stream_dtype)
        self.fit = fit if fit is not None else fit_for(settings, plan, dtype=self.dtype, device=device)
        self.summary: dict[str, Any] = {}
        self.skeleton: Skeleton | None = None
        self.drift: list[float] = []
        self.drift_first: list[float] = []
        self.q_orders: dict[int, list[int] | None] = {}  # each layer's query head order, resumed ones too
        self._block_out: dict[int, dict[str, Tensor]] = {}  # other trained tensors, by layer
        self.ticks: list[float] | None = None  # with a list: the clock at each progress unit (`estimate.probe`)
        self.clock: Callable[[], float] = time.perf_counter
        self.prepare_seconds = 0.0
        self._early: list[float] | None = None  # the first layer's clock, until its early expected-time line
        self._early_at, self._early_steps, self._early_layer, self._t0, self._layers_left = 0, 0, 0, 0.0, (0, 0)
        self._early_said = False

    def layers(self) -> Iterator[tuple[int, AttnHeads]]:
        t0 = time.perf_counter()
        peak = PeakMemory(self.device)
        peak.reset()
        tp = self.clock()
        start = self._prepare()
        self.prepare_seconds = self.clock() - tp
        L_n = self.plan.shape.num_layers
        units = [self.fit.units(len(self.spans), L) + len(self.spans) for L in range(L_n)]
        self.bar = tqdm(total=sum(units), initial=sum(units[:start]), desc="calibrating",
                        unit="batch", disable=not self.progress, dynamic_ncols=True)
        last_save = time.perf_counter()
        for L in range(start, L_n):
            tl = self.clock()
            if self.ticks is not None:
                self.ticks.append(tl)
            self.bar.set_description(f"calibrating layer {L + 1}/{L_n}")
            n = len(self.spans)
            self._early_steps, self._early_layer = self.fit.steps(L), L
            if self.progress and not self._early_said and self._early_steps > 0:  # said early: after a few steps
                # of the first layer that takes steps (a per-layer plan's kept layers take none): before
                # it, the preparation and any kept layers; from it, every layer left, this one included
                self._early_said = True
                trained = sum(1 for i in range(L, L_n) if self.fit.steps(i))
                self._early, self._t0 = [tl], time.perf_counter() - t0
                self._layers_left = (trained, L_n - L - trained)
                self._early_at = 2 * n + min(self._early_steps, PROBE_STEPS)
            ctx = self._context(L)
            fitted = self.fit.fit(ctx)
            if fitted.rest:
                self._block_out[L] = fitted.rest
            self._advance_original(ctx)
            self._advance_converted(ctx, fitted.weights)
            fitted.weights = {}  # the block's weights now: freed with it
            ctx.block.free()
            secs = self.clock() - tl
            self.bar.set_postfix_str(f"{self.tokens / secs:,.0f} tok/s"
                                     + (f", drift {self.drift[-1]:.3f}" if self.drift else ""))
            if L == start and self.progress:  # measured, not guessed: this device, these settings
                left = None if len(set(units[L:])) == 1 else sum(units[L + 1:]) / units[L]
                tqdm.write(expected_time(time.perf_counter() - t0, secs, L_n - L - 1, L_n, left), file=sys.stderr)
            self.q_orders[L] = fitted.heads.q_order
            yield L, fitted.heads
            if (self.resume_dir is not None and L + 1 < L_n
                    and time.perf_counter() - last_save >= float(self.opts.save_seconds)):
                state = {"layers_done": L + 1, "where": self.where, "drift": self.drift,
                         "drift_first": self.drift_first, "written": self.written() if self.written else [],
                         "q_orders": {str(k): v for k, v in self.q_orders.items()}}
                save_state(self.resume_dir, self.seqs, self.streams, state)
                last_save = time.perf_counter()
        self.bar.close()
        self.summary = {
            "calibration": self.where, "calibration_sequences": self.seqs.shape[0], "seq_len": self.seqs.shape[1],
            "tokens": self.tokens, "device": self.device, "compute_dtype": self.opts.dtype,
            "stream_dtype": str(self.stream_dtype).replace("torch.", ""), "streams_on": self.streams.where,
            "stream_bytes": self.streams.nbytes, "batch": self.batch, "options": self.opts.model_dump(),
            "residual_drift": self.drift, "residual_drift_first": self.drift_first,
            "peak_memory_bytes": peak.peak(), "seconds": round(time.perf_counter() - t0, 3),
            "resumed_at_layer": start if self.resumed else None,
            **self.fit.record(),
        }

    def block_tensors(self, L: int) -> dict[str, Tensor]:
        """The other trained tensors of layer L by source name (`train` = "block"), on the CPU;
        each is handed over once, after layer L is yielded."""
        return self._block_out.pop(L, {})

    def describe(self) -> str:
        """What the method did, in one line for the model card (once `layers()` is done)."""
        return self.fit.describe(self.summary)

    def _prepare(self) -> int:
        """Calibration tokens, the skeleton, every block's extra inputs and the two streams
        (from the resume state when resuming). Returns the first layer to fit."""
        L_n = self.plan.shape.num_layers
        state = load_state(self.resume_dir)
        self.resumed = state is not None
        if state is not None:
            assert self.resume_dir is not None
            self.seqs, self.where = load_tokens(self.resume_dir), state["where"]
            start, self.drift, self.drift_first = state["layers_done"], state["drift"], state["drift_first"]
            self.q_orders = {int(k): v for k, v in state.get("q_orders", {}).items()}
        else:
            self.seqs, self.where = calibration_sequences(
                self.opened, self.settings.calibration_data, self.settings.calibration_tokens,
                int(self.opts.seq_len), self.settings.seed, sample_batch=int(self.opts.sample_batch),
                device=self.device, progress=self.progress, source_params=self.plan.source_params)
            start, self.drift, self.drift_first = 0, [], []
        n_seq, T = self.seqs.shape
        self.tokens = n_seq * T
        sk = self.skeleton = Skeleton(self.opened, self.spec, L_n, self.device, self.dtype)
        remap = sk.load_outer(self.seqs)
        self.spans = [slice(i, min(i + self.batch, n_seq)) for i in range(0, n_seq, self.batch)]
        self.group = pass_size(self.batch, T)  # spans a block pass runs at once
        self.passes = pass_groups(self.spans, self.batch, T)
        self.calls: dict[int, list] = {}
        streams: Streams | None = None
        for sl in self.spans:
            if state is not None and (sl.stop - sl.start) in self.calls:
                continue  # resuming: the streams come from the resume state, only the block inputs are needed
            h = sk.block_inputs(remap[self.seqs[sl]], self.calls)
            if streams is None:
                self.hidden = h.shape[-1]
                streams = Streams((n_seq, T, self.hidden), self.stream_dtype, self.opts.offload, self.device,
                                  (self.scratch / "calibration-streams") if self.scratch else None)
            if state is None:
                streams.put("orig", sl, h)
                streams.put("new", sl, h)
        assert streams is not None
        self.streams = streams
        for sl in self.passes:  # the block inputs of a pass's size (the streams are the spans')
            if (sl.stop - sl.start) not in self.calls:
                sk.block_inputs(remap[self.seqs[sl]], self.calls)
        if state is not None:
            assert self.resume_dir is not None
            streams.load(self.resume_dir / STATE)
        return start

    def _context(self, L: int) -> BlockContext:
        """Block L loaded, with what a fit may use of it."""
        assert self.skeleton is not None
        block = Block(self.skeleton, self.spec, L, kv_heads=self.plan.shape.kv_heads_of(L), dtype=self.dtype,
                      autocast=self.opts.dtype == "bfloat16",
                      device=self.device, streams=self.streams, calls=self.calls)
        return BlockContext(block, self.streams, self.spans, self._masks, self.spec, self.plan.shape.at(L),
                            self.settings.kv_heads_at(L), self.hidden, tick=self._tick,
                            note=self.bar.set_postfix_str, passes=self.passes)

    def _tick(self, n: int) -> None:
        """Progress: `n` units done (and their times, when recorded)."""
        self.bar.update(n)
        if self.ticks is not None:
            self.ticks.append(self.clock())
        if self._early is not None:
            self._early.append(self.clock())
            if len(self._early) > self._early_at:
                trained, kept = self._layers_left
                n = len(self.spans)
                tqdm.write(early_line(self._early, spans=n, steps=self._early_steps, layers_left=trained,
                                      kept_left=kept, elapsed=self._t0,
                                      final=self.fit.units(n, self._early_layer) > 2 * n + self._early_steps,
                                      group=self.group),
                           file=sys.stderr)
                self._early = None

    def _masks(self, sl: slice) -> tuple[Tensor, Tensor, Tensor]:
        n_seq, T = self.seqs.shape
        return span_rows(n_seq, T, sl, holdout=float(self.opts.holdout), skip_first=int(self.opts.skip_first),
                         device=self.device)

    def _advance_original(self, ctx: BlockContext) -> None:
        """The original stream advanced one block on every span the fit has not advanced."""
        todo = [sl for sl in self.spans if sl.start not in ctx.advanced]
        if not todo:
            return
        blk = ctx.block
        assert blk.original is not None
        current = {n: p.data for n, p in blk.block.named_parameters() if n in blk.attn_rel.values()}
        blk.use(blk.original)
        with torch.inference_mode():
            for sl in todo:
                ctx.advance_original(sl, blk.run(sl, "orig"))
                self._tick(1)
        blk.use({n: current[r] for n, r in blk.attn_rel.items()})

    def _advance_converted(self, ctx: BlockContext, converted: dict[str, Tensor]) -> None:
        """The converted stream advanced one block; its drift from the original one recorded."""
        blk, D, f64 = ctx.block, self.hidden, torch.float64
        last = blk.L + 1 == self.plan.shape.num_layers
        blk.use(converted)
        blk.original = None
        trim()
        err = torch.zeros(2, dtype=f64, device=self.device)
        cnt = torch.zeros(2, dtype=f64, device=self.device)
        with torch.inference_mode():
            for sl in self.passes:
                rn_next = blk.run(sl, "new")
                self.streams.put("new", sl, rn_next)
                if not last:
                    _, measure, first = self._masks(sl)
                    ro = self.streams.get("orig", sl, self.dtype).reshape(-1, D)
                    rel = ((rn_next.reshape(-1, D) - ro).norm(dim=1).to(f64)
                           / ro.norm(dim=1).to(f64).clamp_min(1e-30))
                    err += torch.stack([rel[measure].sum(), rel[first].sum()])
                    cnt += torch.stack([measure.sum(), first.sum()]).to(f64)
                ctx.done(sl)
        if not last:
            e = (err / cnt.clamp_min(1)).tolist()
            self.drift.append(e[0])
            self.drift_first.append(e[1])
