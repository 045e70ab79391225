"""`DecodeBench`: times prefill and decode of one loaded model over grid points.

Measured the way gpt-fast and transformers' static-cache guide measure it: a static,
pre-allocated KV cache, reset (not reallocated) between repetitions, so allocation never
lands in a timed region; warm-up runs (which also absorb `torch.compile`) excluded and
timed apart; the device synchronized right before and after each timed region; median and
p90 over several repetitions; prompts are random ids, since speed does not depend on the
text.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from gqakit.core.device import PeakMemory, available_memory
from gqakit.runtime.attention import SdpaSpy, describe_path, use_gqa_attention
from gqakit.eval.records import MaxBatch, SpeedPoint
from gqakit.eval.speed.point import OpenPoint, PointCost, step_cost, summarize, timings
from gqakit.eval.speed.steps import CapturedStep, DecodeSteps


def search_max_batch(fits: Callable[[int], bool], limit: int) -> int:
    """The largest batch in 1..`limit` for which `fits(batch)` holds (0 if none): doubling, then bisection."""
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def step_weights(model: Any, elem: int) -> tuple[int, int]:
    """(bytes of the weights a decode step reads, parameters it multiplies by) of a loaded model."""
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is emb
    # A decode step reads every weight once, except an untied input embedding, of which it
    # reads only the B looked-up rows.
    weight_bytes = (params - (0 if tied else emb.numel())) * elem
    # Parameters a step multiplies by (2 FLOPs each per sequence): everything but the input
    # embedding (a lookup), except that a tied embedding is also the LM head.
    return weight_bytes, params - emb.numel() + (emb.numel() if tied else 0)


def stock_sdpa(model: Any) -> str:
    """Switch `model` to transformers' own SDPA attention where it takes it; returns what it runs."""
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, AttributeError, NotImplementedError, KeyError):
        pass
    return str(getattr(model.config, "_attn_implementation", None) or "unknown")


def huge_page_bytes() -> int | None:
    """This process's anonymous memory on transparent huge pages (Linux), or None."""
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class DecodeBench(DecodeSteps):
    """Times prefill and decode of one loaded model with a static KV cache.

    Decode steps run eagerly, through `torch.compile` (`compile=True`), or as one CUDA
    graph per step (`cuda_graphs=True`, CUDA only): the step is captured once per grid
    point on the static cache and replayed, which removes the per-kernel launch and
    Python cost that dominates an eager step of a large model at small batch, without
    any compilation. The first captured graph is checked against the eager step
    (same greedy tokens from the same prompt); if capture or that check fails, the
    bench falls back to eager steps and says why (`graph_error`).
    """

    def __init__(self, model: Any, *, device: Any, dtype: Any, compile: bool = False,
                 cuda_graphs: bool = False, pack_weights: bool = True, decode_kernel: str = "matmul",
                 fuse_layers: bool = True, stock_attention: bool = False) -> None:
        import torch

        from gqakit.runtime.packed import can_pack

        super().__init__(model, device=device, dtype=dtype, decode_kernel=decode_kernel)
        self.elem = torch.finfo(dtype).bits // 8
        # Packed weights (decode.packed.packed_linears): CPU eager steps from batch 2 up, or from
        # batch 1 with gqakit's compiled CPU kernels (fp32; built on first use, cached), which
        # also run the decode attention fused. Without them (no compiler, another dtype), the
        # oneDNN layout and the matmul attention; `kernel_note` says why.
        # Under --compile the kernels are custom ops in the compiled graph (oneDNN's packed
        # linear is not: inductor's lowering of it fails), so compile packs only with them.
        self.pack_weights = bool(pack_weights) and can_pack(self.device, dtype)
        self.kernels = None
        self.kernel_note: str | None = None
        # With the kernels, eager decode steps of a Llama-layout model run one compiled call per
        # layer (decode.layers.FusedDecode: its packed weights, built and checked against the
        # model's own step on first use, live as long as this object); `fused_note` says why
        # not where it does not apply.
        self.fuse_layers = bool(fuse_layers)
        self.fused_note: str | None = None
        self._fused_tried = False
        self.fused_huge_fraction: float | None = None
        if self.pack_weights and decode_kernel == "matmul" and dtype == torch.float32:
            from gqakit.runtime import kernels as cpu_kernels

            self.kernels = cpu_kernels.load()
            if self.kernels is None:
                self.kernel_note = f"gqakit CPU kernels unavailable ({cpu_kernels.why_unavailable()})"
            else:
                self.decode_kernel = "cpu"
        if compile and self.kernels is None:
            self.pack_weights = False
        # stock_attention: transformers' own SDPA attention (the transformers engine), else gqakit_sdpa
        self.attn_impl = stock_sdpa(model) if stock_attention else use_gqa_attention(model, self.decode_kernel)
        self.engine: str | None = None   # the engine name the points record (eval.speed.grid sets it)
        self.weight_bytes, self.matmul_params = step_weights(model, self.elem)
        self.kv_bytes_per_token = self.shape.kv_bytes_per_token(self.elem)
        self.kv_window_shares = self.shape.window_shares()  # sliding layers read min(window, depth)
        self.compiled = False
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda" and not compile
        self.graph_error: str | None = None
        self.graph_checked = False
        if compile:
            # On the CPU, inductor's weight freezing folds the weights into the compiled step as
            # constants, and the small ops (norms, rotary, softmax) are fused.
            cpu = self.device.type == "cpu"
            how = {"options": {"freezing": True}} if cpu else {"mode": "reduce-overhead"}
            # one compiled graph per model, prompt length and batch (prefill and decode): a grid
            # of several models needs more than dynamo's default of 8 per code object
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(int(dynamo_config.recompile_limit), 256)
            dynamo_config.accumulated_recompile_limit = max(int(dynamo_config.accumulated_recompile_limit), 4096)
            self.step = torch.compile(model, fullgraph=True, dynamic=False, **how)
            self.compiled = True

    # -- the path a step takes ------------------------------------------------------------
    @property
    def decode_mode(self) -> str:
        if self.compiled:
            if self.kernels is not None:
                return "torch.compile, gqakit CPU kernels as custom ops (panel GEMM, fused decode attention)"
            return "torch.compile, weights frozen" if self.device.type == "cpu" else "torch.compile"
        if self.cuda_graphs:
            return "CUDA graph per step"
        if self.kernels is not None and self.fuse_layers and self.fused_note is None:
            return "eager, gqakit CPU kernels in fused decode layers (one call per layer: panel GEMMs, fused attention)"
        return "eager, gqakit CPU kernels (panel GEMM, fused decode attention)" if self.kernels is not None else "eager"

    def probe(self) -> dict[str, Any]:
        """Which attention path a decode step really takes (one eager step, SDPA calls recorded)."""
        import torch

        self.select_kernel()
        spy = SdpaSpy()
        with torch.inference_mode():
            cache = self.new_cache(1, 8)
            self.generate(cache, torch.randint(0, self.vocab, (1, 4), device=self.device), 1, spy=spy)
        return {"implementation": self.attn_impl, **describe_path(spy.calls, self.heads, self.kv_heads),
                "kv_cache": "transformers.StaticCache (pre-allocated)", "compiled": self.compiled,
                "cuda_graphs": self.cuda_graphs, **({"kernel_note": self.kernel_note} if self.kernel_note else {})}

    def graph_for(self, cache: Any, batch: int, prompt_len: int, new_tokens: int) -> CapturedStep | None:
        """A checked CUDA graph for this point, or None (eager steps) when graphs are off or failed."""
        import torch

        if not self.cuda_graphs:
            return None
        try:
            graph = self.capture_graph(cache, batch)
            if not self.graph_checked:
                # Same prompt, eager then graphed: the greedy tokens must agree exactly
                # (a replay runs the very kernels the eager step ran).
                prompt = torch.randint(0, self.vocab, (batch, prompt_len), device=self.device)
                eager: list = []
                graphed: list = []
                cache.reset()
                self.generate(cache, prompt, new_tokens, tokens=eager)
                cache.reset()
                self.generate(cache, prompt, new_tokens, graph=graph, tokens=graphed)
                cache.reset()
                if not torch.equal(torch.cat(eager, 1), torch.cat(graphed, 1)):
                    raise RuntimeError("graph replay gave other greedy tokens than the eager steps")
                self.graph_checked = True
            return graph
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # capture refused (a sync inside the step, say): measure eagerly
            self.graph_error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            self.cuda_graphs = False
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                pass
            cache.reset()
            return None

    def build_fused(self) -> None:
        """Pack and check the fused step once per model (at the first grid point that uses it)."""
        if self._fused_tried:
            return
        from gqakit.runtime.layers import build_fused_decode

        before = huge_page_bytes()
        self.fused, self.fused_note = build_fused_decode(self.model, self.kernels, self.new_cache, self.vocab,
                                                         self.cache_kw)
        self._fused_tried = True
        after = huge_page_bytes()
        if self.fused is not None and before is not None and after is not None:
            # how much of the packed weights the kernel put on huge pages
            self.fused_huge_fraction = min(1.0, max(0, after - before) / self.fused.packed_bytes)

    # -- memory model ---------------------------------------------------------------------
    def predicted_bytes(self, batch: int, prompt_len: int, new_tokens: int) -> int:
        """Memory a grid point adds beyond the loaded weights: cache + prefill activations.

        Used on CPU, where running out of memory kills the process instead of raising.
        Activations: a handful of hidden-size and MLP-size tensors per prompt token, the
        kept logits, and attention scores in case SDPA materialises them.
        """
        cache = batch * (prompt_len + new_tokens) * self.kv_bytes_per_token
        hidden = int(self.cfg.hidden_size)
        inter = int(getattr(self.cfg, "intermediate_size", None) or 4 * hidden)
        act = batch * prompt_len * (6 * hidden + 3 * inter) * 4
        scores = batch * self.heads * prompt_len * prompt_len * 4
        logits = batch * self.vocab * 4 * (1 if self.keep else prompt_len)
        return cache + act + scores + logits

    def fits_predicted(self, batch: int, prompt_len: int, new_tokens: int) -> tuple[bool, str]:
        """Whether the predicted bytes fit in 80% of the available memory, and the sentence that says so."""
        need, avail = self.predicted_bytes(batch, prompt_len, new_tokens), available_memory(self.device)
        return need <= 0.8 * avail, f"predicted {need / 2**30:.2f} GiB > 80% of {avail / 2**30:.2f} GiB available"

    def fits(self, batch: int, prompt_len: int, new_tokens: int, *, prefill: bool = True) -> bool:
        """Whether (batch, prompt_len) runs: tried for real on CUDA, predicted on CPU.

        With `prefill=False`, whether a cache of `prompt_len + new_tokens` positions and one
        decode step at its end fit (no prompt run: the cache alone).
        """
        import torch

        if self.device.type != "cuda":
            return (self.fits_predicted(batch, prompt_len, new_tokens) if prefill
                    else self.fits_predicted(batch, 1, prompt_len + new_tokens))[0]
        cache = prompt = None
        try:
            with torch.inference_mode():
                if prefill:
                    cache = self.new_cache(batch, prompt_len + 2)
                    prompt = torch.randint(0, self.vocab, (batch, prompt_len), device=self.device)
                    self.generate(cache, prompt, 2)
                else:
                    length = prompt_len + new_tokens
                    cache = self.new_cache(batch, length)
                    self.rewind(cache, length - 1)
                    self.decode(cache, torch.zeros((batch, 1), dtype=torch.long, device=self.device), length - 1, 1)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            cache = prompt = None
            torch.cuda.empty_cache()

    def max_batch(self, prompt_len: int, new_tokens: int, limit: int, *, prefill: bool = True) -> MaxBatch:
        """Largest batch that fits at `prompt_len` (`fits`): doubling, then bisection."""
        lo = search_max_batch(lambda b: self.fits(b, prompt_len, new_tokens, **({} if prefill else {"prefill": False})),
                              limit)
        method = "allocation attempts" if self.device.type == "cuda" else "predicted from available host memory"
        return MaxBatch(prompt_len=prompt_len, max_batch=lo, at_limit=lo >= limit, limit=limit, method=method)

    # -- one grid point -------------------------------------------------------------------
    def open_point(self, batch: int, prompt_len: int, new_tokens: int, warmup: int, *,
                   prefill_once: bool = False) -> OpenPoint:
        """Set up one grid point: cache, packed weights, CUDA graph, warm-up (compile included).

        Returns the point's state for `rep` (or `begin_rep` + `timed_step`) and `close_point`;
        its `result` is already set when the point does not fit. Two models' points can be
        open at once and their repetitions alternated, so machine drift hits both alike.
        """
        import torch

        pt = OpenPoint(batch, prompt_len, new_tokens)
        if self.device.type != "cuda":
            ok, why = self.fits_predicted(batch, prompt_len, new_tokens)
            if not ok:
                pt.result = SpeedPoint(**pt.axes, status="oom", reason=why)
                return pt
        self.select_kernel()
        pt.peak = PeakMemory(self.device)
        # Inference mode is entered around each call, never held in `stack`: points of two
        # models can be open at once and closed in any order, and a grad-mode context
        # closed out of order would leave inference mode switched on for the process.
        try:
            with torch.inference_mode():
                self._open(pt, warmup, prefill_once)
            return pt
        except torch.OutOfMemoryError:
            pt.stack.close()
            torch.cuda.empty_cache()
            return OpenPoint(batch, prompt_len, new_tokens,
                             result=SpeedPoint(**pt.axes, status="oom", reason="torch.OutOfMemoryError"))
        except BaseException:
            pt.stack.close()
            raise

    def _open(self, pt: OpenPoint, warmup: int, prefill_once: bool) -> None:
        from gqakit.runtime.packed import packed_linears

        cache = self.new_cache(pt.batch, pt.prompt_len + pt.new_tokens)
        pt.kv_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        if self.pack_weights and self.kernels is not None and not self.compiled and self.fuse_layers:
            self.build_fused()  # packed and checked once per model, reused at every point
            if self.fused is not None:
                pt.packed_bytes = self.fused.packed_bytes
        if self.fused is None and self.pack_weights and (pt.batch > 1 or self.kernels is not None):
            pt.packed_bytes = pt.stack.enter_context(packed_linears(self.model, pt.batch, kernels=self.kernels))
        t0 = time.perf_counter()
        pt.graph = self.graph_for(cache, pt.batch, pt.prompt_len, pt.new_tokens)  # capture counts as warm-up
        first: list[float] = []
        pt.cache = cache
        pt.rewind = prefill_once and all(not getattr(x, "is_sliding", False) and hasattr(x, "cumulative_length")
                                         for x in cache.layers)
        for i in range(warmup):
            self._rep(pt, first_step=first if i == 0 else None, record=False)
        pt.warmup_s = time.perf_counter() - t0
        pt.compile_s = first[0] if (first and self.compiled) else None
        pt.peak.reset()

    def _rep(self, pt: OpenPoint, first_step: list | None = None, record: bool = True) -> None:
        import torch

        if pt.rewind and pt.tok is not None:
            self.rewind(pt.cache, pt.prompt_len)  # prompt kept from the one prefill
        else:
            pt.cache.reset()
            prompt = torch.randint(0, self.vocab, (pt.batch, pt.prompt_len), device=self.device)
            pre, pt.tok = self.prefill(pt.cache, prompt)
            if record or pt.rewind:
                pt.pre.append(pre)
        d, _ = self.decode(pt.cache, pt.tok, pt.prompt_len, pt.new_tokens, graph=pt.graph, first_step=first_step)
        if record:
            pt.dec.append(d / pt.new_tokens)
            pt.reps += 1

    def rep(self, pt: OpenPoint) -> None:
        """One timed repetition of an open point: prefill (unless done once) and the decode steps."""
        import torch

        self.select_kernel()
        with torch.inference_mode():
            self._rep(pt)

    def begin_rep(self, pt: OpenPoint) -> None:
        """Start a repetition step by step (see `timed_step`): rewind to the prompt, or prefill again."""
        import torch

        self.select_kernel()
        with torch.inference_mode():
            if pt.rewind and pt.tok is not None:
                self.rewind(pt.cache, pt.prompt_len)
            else:
                pt.cache.reset()
                prompt = torch.randint(0, self.vocab, (pt.batch, pt.prompt_len), device=self.device)
                pre, pt.tok = self.prefill(pt.cache, prompt)
                pt.pre.append(pre)
        pt.tok0, pt.i = pt.tok, 0
        pt.reps += 1

    def timed_step(self, pt: OpenPoint) -> float:
        """One timed decode step of the current repetition; its time is recorded as a sample.

        Lets several models' steps alternate one by one (`grid.run_points_alternating`), the
        finest interleaving there is: each pair of steps sees the same machine load.
        """
        import torch

        self.select_kernel()
        with torch.inference_mode():
            d, pt.cur = self.decode(pt.cache, pt.cur if pt.i else pt.tok0, pt.prompt_len + pt.i, 1, graph=pt.graph)
        pt.i += 1
        pt.dec.append(d)
        return d

    def close_point(self, pt: OpenPoint, roof: dict[str, float]) -> SpeedPoint:
        """Release an open point and return its measurements."""
        if pt.result is not None:
            return pt.result
        peak = pt.peak.peak()
        graph_used = pt.graph is not None
        pt.stack.close()
        pt.cache = pt.graph = pt.tok = pt.tok0 = pt.cur = None
        pt.result = summarize(self, pt, roof, graph_used=graph_used, peak=peak)
        return pt.result

    def point_cost(self, pt: OpenPoint) -> PointCost:
        """Minimum bytes a step must read: the weights once and the filled cache (mean over the steps)."""
        return step_cost(self, pt)

    def point_path(self, pt: OpenPoint, graph_used: bool) -> tuple[str, dict[str, Any]]:
        """The decode mode of a closed point, and which path each part of its step took."""
        mode = "CUDA graph per step" if graph_used else self.decode_mode
        layers: dict[str, Any] = {}
        if self.kernels is not None and not self.compiled:
            if self.fused is not None:
                layers["layers"] = "fused, one compiled call per layer"
                if self.fused_huge_fraction is not None:
                    layers["packed_on_huge_pages"] = round(self.fused_huge_fraction, 3)
            else:
                layers["layers"] = "per-op (transformers' modules)" + (f": {self.fused_note}" if self.fused_note else "")
        weights = ("as loaded" if not pt.packed_bytes else "packed once (gqakit panels)" if self.kernels is not None
                   else "packed once (oneDNN)")
        return mode, {"steps": mode, "weights": weights, "attention_kernel": self.decode_kernel, **layers,
                      "prefill": "every repetition" if len(pt.pre) >= pt.reps
                      else "once, decode repetitions rewind the cache"}

    def prefill_fields(self, pt: OpenPoint) -> dict[str, Any]:
        """The prefill samples and the timings of a closed point."""
        return {"prefill_samples": len(pt.pre), **timings(pt.batch, pt.pre, pt.dec)}

    def run_point(self, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int,
                  roof: dict[str, float], *, prefill_once: bool = False) -> SpeedPoint:
        """One grid point, start to end: open, `reps` repetitions, close (out of memory is a result)."""
        pt = self.open_point(batch, prompt_len, new_tokens, warmup, prefill_once=prefill_once)
        if pt.result is not None:
            return pt.result
        try:
            for _ in range(reps):
                self.rep(pt)
        except BaseException as e:
            pt.stack.close()
            if type(e).__name__ == "OutOfMemoryError":
                import torch

                torch.cuda.empty_cache()
                return SpeedPoint(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, status="oom",
                                  reason="torch.OutOfMemoryError")
            raise
        return self.close_point(pt, roof)
