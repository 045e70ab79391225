"""Decode speed: prefill (time to first token) and per-token decode over a batch x prompt grid.

Measured the way gpt-fast and transformers' static-cache guide measure it:
- a static, pre-allocated KV cache (`transformers.StaticCache`), reset (not reallocated)
  between repetitions, so allocation never lands in a timed region;
- warm-up runs (which also absorb `torch.compile`) are excluded and timed apart;
- the device is synchronized right before and right after each timed region;
- greedy next tokens stay on the device (no `.item()` per step, which would add a sync);
- median and p90 over several repetitions; prompts are random ids, since speed does not
  depend on the text.

Each grid point also gets the roofline view: bytes a decode step must read (all weights
once, plus the filled part of the KV cache) divided by the step time gives the achieved
bandwidth, quoted as a fraction of the copy bandwidth measured on the same device in the
same run; and its arithmetic intensity against the device's measured ridge point says
whether the point is memory-bound.
"""

from __future__ import annotations

import inspect
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from gqakit.core.arch import loaded_shape
from gqakit.core.device import PeakMemory, available_memory  # noqa: F401  (re-exported)
from gqakit.core.errors import GqakitError
from gqakit.core.loading import cache_kwarg
from gqakit.eval.attention import SdpaSpy, describe_path, use_gqa_attention
from gqakit.eval.records import MaxBatch, SpeedPoint, SpeedResult


# ----------------------------------------------------------------------------- device facts

def sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Any, device: Any, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: Any, nbytes: int | None = None, reps: int = 5) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), the practical roof."""
    import torch

    dev = torch.device(device)
    nbytes = nbytes or (1 << 30 if dev.type == "cuda" else 256 << 20)
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), dev, reps)
    return 2 * nbytes / t


def matmul_flops(device: Any, dtype: Any, n: int | None = None, reps: int = 3) -> float:
    """FLOP/s of a square matmul in `dtype`: the compute roof for the ridge point."""
    import torch

    dev = torch.device(device)
    n = n or (8192 if dev.type == "cuda" else 1024)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = _median_time(lambda: a @ b, dev, reps)
    return 2 * n ** 3 / t


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ----------------------------------------------------------------------------- the benchmark

@dataclass
class SpeedSettings:
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_lens: tuple[int, ...] = (128, 1024)
    new_tokens: int = 128
    reps: int = 5
    warmup: int = 1
    compile: bool = False
    max_batch_search: bool = False
    max_batch_limit: int = 4096
    eager: bool = False          # --eager: no packed weights, SDPA decode kernel (the plain transformers step)
    prefill_once: bool = False   # time prefill once per point; decode repetitions rewind the cache to the prompt


class DecodeBench:
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
                 fuse_layers: bool = True) -> None:
        import torch

        from gqakit.eval.attention import set_decode_kernel
        from gqakit.eval.decode_fast import can_pack

        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self._cache_kw = cache_kwarg(model)  # `cache` from transformers 5.24, else `past_key_values`
        self.cfg = model.config.get_text_config(decoder=True)
        shape = loaded_shape(self.cfg)
        self.heads, self.kv_heads, self.head_dim, self.layers = (shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                                                 shape.num_layers)
        self.vocab = int(self.cfg.vocab_size)
        self.elem = torch.finfo(dtype).bits // 8
        self.attn_impl = use_gqa_attention(model)
        # Packed weights (decode_fast.packed_linears): CPU eager steps from batch 2 up, or from
        # batch 1 with gqakit's compiled CPU kernels (fp32; built on first use, cached), which
        # also run the decode attention fused. Without them (no compiler, another dtype), the
        # oneDNN layout and the matmul attention; `kernel_note` says why.
        # Under --compile the kernels are custom ops in the compiled graph (oneDNN's packed
        # linear is not: inductor's lowering of it fails), so compile packs only with them.
        self.pack_weights = bool(pack_weights) and can_pack(self.device, dtype)
        self.kernels = None
        self.kernel_note: str | None = None
        # With the kernels, eager decode steps of a Llama-layout model run one compiled call per
        # layer (decode_layers.FusedDecode: its packed weights, built and checked against the
        # model's own step on first use, live as long as this object); `fused_note` says why
        # not where it does not apply.
        self.fuse_layers = bool(fuse_layers)
        self._fused_built: tuple[Any, str | None] | None = None  # (FusedDecode or None, why not)
        self.fused_huge_fraction: float | None = None
        if self.pack_weights and decode_kernel == "matmul" and dtype == torch.float32:
            from gqakit.eval import cpu_kernels

            self.kernels = cpu_kernels.load()
            if self.kernels is None:
                self.kernel_note = f"gqakit CPU kernels unavailable ({cpu_kernels.why_unavailable()})"
            else:
                decode_kernel = "cpu"
        if compile and self.kernels is None:
            self.pack_weights = False
        set_decode_kernel(decode_kernel)
        self.decode_kernel = decode_kernel
        params = sum(p.numel() for p in model.parameters())
        emb = model.get_input_embeddings().weight
        tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is emb
        # A decode step reads every weight once, except an untied input embedding, of
        # which it reads only the B looked-up rows.
        self.weight_bytes = (params - (0 if tied else emb.numel())) * self.elem
        # Parameters a step multiplies by (2 FLOPs each per sequence): everything but the
        # input embedding (a lookup), except that a tied embedding is also the LM head. An
        # untied LM head is already in `params` on its own; adding the input embedding back
        # for it counted the head twice.
        self.matmul_params = params - emb.numel() + (emb.numel() if tied else 0)
        self.kv_bytes_per_token = shape.kv_bytes_per_token(self.elem)
        sig = inspect.signature(model.forward).parameters
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in sig else {}
        self.compiled = False
        self.step = model
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda" and not compile
        self.graph_error: str | None = None
        self._graph_checked = False
        if compile:
            # On the CPU, inductor's weight freezing folds the weights into the compiled step as
            # constants, and the small ops (norms, rotary, softmax) are fused: SmolLM2's step at
            # batch 8 x prompt 1024 reached 59-82% of the predicted GQA speedup against 60% for
            # the eager fast path (docs/benchmarks.md; the fp32 weight matmuls stay ATen's mm).
            cpu = self.device.type == "cpu"
            how = {"options": {"freezing": True}} if cpu else {"mode": "reduce-overhead"}
            # one compiled graph per model, prompt length and batch (prefill and decode): a grid
            # of several models needs more than dynamo's default of 8 per code object
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(int(dynamo_config.recompile_limit), 256)
            dynamo_config.accumulated_recompile_limit = max(int(dynamo_config.accumulated_recompile_limit), 4096)
            self.step = torch.compile(model, fullgraph=True, dynamic=False, **how)
            self.compiled = True

    # -- one generation -------------------------------------------------------------------
    def _cache(self, batch: int, max_len: int) -> Any:
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        cache.early_initialization(batch, self.kv_heads, self.head_dim, self.dtype, self.device)
        return cache

    def _prefill(self, cache: Any, prompt: Any) -> tuple[float, Any]:
        """The prompt through the model into `cache`: (seconds, first greedy token)."""
        import torch

        b, p = prompt.shape
        pos = torch.arange(p, device=self.device).unsqueeze(0)
        sync(self.device)
        t0 = time.perf_counter()
        logits = self.model(input_ids=prompt, **{self._cache_kw: cache}, position_ids=pos, use_cache=True,
                            **self._keep).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        sync(self.device)
        return time.perf_counter() - t0, tok

    def _decode(self, cache: Any, tok: Any, start: int, new_tokens: int, spy: SdpaSpy | None = None,
                graph: tuple | None = None, tokens: list | None = None, first_step: list | None = None,
                last: dict | None = None) -> float:
        """`new_tokens` greedy decode steps from position `start`; returns seconds.

        With `graph` (from `_capture`), decode steps are replays of it; `tokens`, when
        given, collects the greedy tokens (device tensors, no sync); `first_step`, when
        given, gets the wall time of the first step (where `torch.compile` compiles).
        """
        import torch

        sync(self.device)
        t1 = time.perf_counter()
        for i in range(new_tokens):
            if tokens is not None:
                tokens.append(tok)
            if graph is not None:
                g, g_tok, g_pos, g_logits = graph
                g_tok.copy_(tok)
                g_pos.fill_(start + i)
                g.replay()
                tok = g_logits[:, -1].argmax(-1, keepdim=True)
                continue
            pos = torch.full((1, 1), start + i, device=self.device, dtype=torch.long)
            if self._fused is not None and spy is None:
                out = self._fused(input_ids=tok, **{self._cache_kw: cache}, position_ids=pos)
            elif spy is not None and i == 0:
                with spy:  # eager model, so the spy sees the real attention calls
                    out = self.model(input_ids=tok, **{self._cache_kw: cache}, position_ids=pos, use_cache=True)
            else:
                out = self.step(input_ids=tok, **{self._cache_kw: cache}, position_ids=pos, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            if first_step is not None and i == 0:
                sync(self.device)
                first_step.append(time.perf_counter() - t1)
        sync(self.device)
        dt = time.perf_counter() - t1
        if last is not None:
            last["cur"] = tok
        return dt

    def _generate(self, cache: Any, prompt: Any, new_tokens: int, spy: SdpaSpy | None = None,
                  graph: tuple | None = None, tokens: list | None = None) -> tuple[float, float]:
        """Prefill + `new_tokens` decode steps; returns (prefill s, decode s)."""
        pre, tok = self._prefill(cache, prompt)
        return pre, self._decode(cache, tok, prompt.shape[1], new_tokens, spy=spy, graph=graph, tokens=tokens)

    @staticmethod
    def rewind(cache: Any, length: int) -> None:
        """Make `cache` hold only its first `length` positions again (prompt kept, decode undone).

        Later slots keep stale values, but the causal mask hides every slot past the
        position being decoded, and each step writes its own slot before attending.
        """
        for layer in cache.layers:
            layer.cumulative_length.fill_(length)

    def _capture(self, cache: Any, batch: int) -> tuple:
        """One decode step on `cache` as a CUDA graph: (graph, token in, position in, logits out).

        Static buffers carry the step's inputs and output. transformers' StaticCache keeps
        its tensors and its fill counter on the device at fixed addresses, so a replay
        writes the next cache slot just as the eager step does. The two warm-up steps on
        a side stream (which capture requires) and the capture itself move the cache:
        it is reset before returning.
        """
        import torch

        tok = torch.zeros((batch, 1), dtype=torch.long, device=self.device)
        pos = torch.zeros((1, 1), dtype=torch.long, device=self.device)

        def step() -> Any:
            return self.model(input_ids=tok, **{self._cache_kw: cache}, position_ids=pos, use_cache=True, **self._keep).logits

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        cache.reset()
        return graph, tok, pos, logits

    def _graph_for(self, cache: Any, batch: int, prompt_len: int, new_tokens: int) -> tuple | None:
        """A checked CUDA graph for this point, or None (eager steps) when graphs are off or failed."""
        import torch

        if not self.cuda_graphs:
            return None
        try:
            graph = self._capture(cache, batch)
            if not self._graph_checked:
                # Same prompt, eager then graphed: the greedy tokens must agree exactly
                # (a replay runs the very kernels the eager step ran).
                prompt = torch.randint(0, self.vocab, (batch, prompt_len), device=self.device)
                eager: list = []
                graphed: list = []
                cache.reset()
                self._generate(cache, prompt, new_tokens, tokens=eager)
                cache.reset()
                self._generate(cache, prompt, new_tokens, graph=graph, tokens=graphed)
                cache.reset()
                if not torch.equal(torch.cat(eager, 1), torch.cat(graphed, 1)):
                    raise RuntimeError("graph replay gave other greedy tokens than the eager steps")
                self._graph_checked = True
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

    @property
    def _fused(self) -> Any:
        """The checked fused step once built (at the first grid point), else None."""
        return None if self._fused_built is None else self._fused_built[0]

    @property
    def fused_note(self) -> str | None:
        """Why the fused step does not apply, once that is known."""
        return None if self._fused_built is None else self._fused_built[1]

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

        from gqakit.eval.attention import set_decode_kernel

        set_decode_kernel(self.decode_kernel)
        spy = SdpaSpy()
        with torch.inference_mode():
            cache = self._cache(1, 8)
            self._generate(cache, torch.randint(0, self.vocab, (1, 4), device=self.device), 1, spy=spy)
        return {"implementation": self.attn_impl, **describe_path(spy.calls, self.heads, self.kv_heads),
                "kv_cache": "transformers.StaticCache (pre-allocated)", "compiled": self.compiled,
                "cuda_graphs": self.cuda_graphs, **({"kernel_note": self.kernel_note} if self.kernel_note else {})}

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
        logits = batch * self.vocab * 4 * (1 if self._keep else prompt_len)
        return cache + act + scores + logits

    def _fits_predicted(self, batch: int, prompt_len: int, new_tokens: int) -> tuple[bool, str]:
        need, avail = self.predicted_bytes(batch, prompt_len, new_tokens), available_memory(self.device)
        return need <= 0.8 * avail, f"predicted {need / 2**30:.2f} GiB > 80% of {avail / 2**30:.2f} GiB available"

    def fits(self, batch: int, prompt_len: int, new_tokens: int) -> bool:
        """Whether (batch, prompt_len) runs: tried for real on CUDA, predicted on CPU."""
        import torch

        if self.device.type != "cuda":
            return self._fits_predicted(batch, prompt_len, new_tokens)[0]
        try:
            with torch.inference_mode():
                cache = self._cache(batch, prompt_len + 2)
                prompt = torch.randint(0, self.vocab, (batch, prompt_len), device=self.device)
                self._generate(cache, prompt, 2)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            cache = prompt = None
            torch.cuda.empty_cache()

    def max_batch(self, prompt_len: int, new_tokens: int, limit: int) -> MaxBatch:
        """Largest batch that fits at `prompt_len`: doubling, then bisection."""
        lo, hi = 0, 1
        while hi <= limit and self.fits(hi, prompt_len, new_tokens):
            lo, hi = hi, hi * 2
        hi = min(hi, limit + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid, prompt_len, new_tokens) else (lo, mid)
        method = "allocation attempts" if self.device.type == "cuda" else "predicted from available host memory"
        return MaxBatch(prompt_len=prompt_len, max_batch=lo, at_limit=lo >= limit, limit=limit, method=method)

    # -- one grid point -----------------------------------------------------------------
    def open_point(self, batch: int, prompt_len: int, new_tokens: int, warmup: int, *,
                   prefill_once: bool = False) -> dict[str, Any]:
        """Set up one grid point: cache, packed weights, CUDA graph, warm-up (compile included).

        Returns the point's state for `rep` and `close_point`, or `{"result": ...}` when the
        point does not fit. Two models' points can be open at once and their repetitions
        alternated (bench/bench_decode_pair.py), so machine drift hits both alike.
        """
        import contextlib

        import torch

        from gqakit.eval.attention import set_decode_kernel
        from gqakit.eval.decode_fast import packed_linears

        point: dict[str, Any] = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens}
        if self.device.type != "cuda":
            ok, why = self._fits_predicted(batch, prompt_len, new_tokens)
            if not ok:
                return {"result": SpeedPoint(**point, status="oom", reason=why)}
        set_decode_kernel(self.decode_kernel)
        st: dict[str, Any] = {"point": point, "stack": contextlib.ExitStack(), "peak": PeakMemory(self.device)}
        # Inference mode is entered around each call, never held in `stack`: points of two
        # models can be open at once and closed in any order, and a grad-mode context
        # closed out of order would leave inference mode switched on for the process.
        try:
            with torch.inference_mode():
                return self._open(st, batch, prompt_len, new_tokens, warmup, prefill_once, packed_linears)
        except torch.OutOfMemoryError:
            st["stack"].close()
            st.clear()
            torch.cuda.empty_cache()
            return {"result": SpeedPoint(**point, status="oom", reason="torch.OutOfMemoryError")}
        except BaseException:
            st["stack"].close()
            raise

    def _open(self, st: dict[str, Any], batch: int, prompt_len: int, new_tokens: int, warmup: int,
              prefill_once: bool, packed_linears: Any) -> dict[str, Any]:
        cache = self._cache(batch, prompt_len + new_tokens)
        st["kv_bytes"] = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        st["packed_bytes"] = 0
        fused = None
        if self.pack_weights and self.kernels is not None and not self.compiled and self.fuse_layers:
            if self._fused_built is None:  # packed and checked once per model, reused at every point
                from gqakit.eval.decode_layers import build_fused_decode

                before = huge_page_bytes()
                self._fused_built = build_fused_decode(self.model, self.kernels, self._cache, self.vocab, self._cache_kw)
                after = huge_page_bytes()
                if self._fused_built[0] is not None and before is not None and after is not None:
                    # how much of the packed weights the kernel put on huge pages (a record: the
                    # slow runs once blamed on 4 KiB pages were a refused check, docs/decode.md)
                    self.fused_huge_fraction = min(1.0, max(0, after - before) / self._fused_built[0].packed_bytes)
            fused = self._fused
            if fused is not None:
                st["packed_bytes"] = fused.packed_bytes
        if fused is None and self.pack_weights and (batch > 1 or self.kernels is not None):
            st["packed_bytes"] = st["stack"].enter_context(packed_linears(self.model, batch, kernels=self.kernels))
        t0 = time.perf_counter()
        graph = self._graph_for(cache, batch, prompt_len, new_tokens)  # capture counts as warm-up
        first: list[float] = []
        st.update(cache=cache, graph=graph, tok=None, pre=[], dec=[], reps=0,
                  rewind=prefill_once and all(not getattr(x, "is_sliding", False) and hasattr(x, "cumulative_length")
                                              for x in cache.layers))
        for i in range(warmup):
            self._rep(st, first_step=first if i == 0 else None, record=False)
        st["warmup_s"] = time.perf_counter() - t0
        st["compile_s"] = first[0] if (first and self.compiled) else None
        st["peak"].reset()
        return st

    def _rep(self, st: dict[str, Any], first_step: list | None = None, record: bool = True) -> None:
        import torch

        b, p, n = st["point"]["batch"], st["point"]["prompt_len"], st["point"]["new_tokens"]
        cache = st["cache"]
        if st["rewind"] and st["tok"] is not None:
            self.rewind(cache, p)  # prompt kept from the one prefill
        else:
            cache.reset()
            prompt = torch.randint(0, self.vocab, (b, p), device=self.device)
            pre, st["tok"] = self._prefill(cache, prompt)
            if record or st["rewind"]:
                st["pre"].append(pre)
        d = self._decode(cache, st["tok"], p, n, graph=st["graph"], first_step=first_step)
        if record:
            st["dec"].append(d / n)
            st["reps"] += 1

    def begin_rep(self, st: dict[str, Any]) -> None:
        """Start a repetition step by step (see `step`): rewind to the prompt, or prefill again."""
        import torch

        from gqakit.eval.attention import set_decode_kernel

        set_decode_kernel(self.decode_kernel)
        b, p = st["point"]["batch"], st["point"]["prompt_len"]
        with torch.inference_mode():
            if st["rewind"] and st["tok"] is not None:
                self.rewind(st["cache"], p)
            else:
                st["cache"].reset()
                pre, st["tok"] = self._prefill(st["cache"], torch.randint(0, self.vocab, (b, p), device=self.device))
                st["pre"].append(pre)
        st["tok0"], st["i"] = st["tok"], 0
        st["reps"] += 1

    def decode_step(self, st: dict[str, Any]) -> float:
        """One timed decode step of the current repetition; its time is recorded as a sample.

        Lets two models' steps alternate one by one (bench/bench_decode_pair.py), the finest
        interleaving there is: each pair of steps sees the same machine load.
        """
        import torch

        from gqakit.eval.attention import set_decode_kernel

        set_decode_kernel(self.decode_kernel)
        i = st["i"]
        with torch.inference_mode():
            d = self._decode(st["cache"], st["cur"] if i else st["tok0"], st["point"]["prompt_len"] + i, 1,
                             graph=st["graph"], last=st)
        st["i"] = i + 1
        st["dec"].append(d)
        return d

    def rep(self, st: dict[str, Any]) -> None:
        """One timed repetition of an open point: prefill (unless done once) and the decode steps."""
        from gqakit.eval.attention import set_decode_kernel

        import torch

        set_decode_kernel(self.decode_kernel)
        with torch.inference_mode():
            self._rep(st)

    def close_point(self, st: dict[str, Any], roof: dict[str, float]) -> SpeedPoint:
        """Release an open point and return its measurements."""
        if "result" in st:
            return st["result"]
        peak = st["peak"].peak()
        graph_used = st["graph"] is not None
        st["stack"].close()
        point, pre, dec, reps = st["point"], st["pre"], st["dec"], st["reps"]
        warm, compile_s, kv_bytes, packed = st["warmup_s"], st["compile_s"], st["kv_bytes"], st["packed_bytes"]
        batch, prompt_len, new_tokens = point["batch"], point["prompt_len"], point["new_tokens"]
        st.clear()
        step = statistics.median(dec)
        # Minimum bytes a step must read: weights once + the filled cache (mean over steps).
        mean_len = prompt_len + (new_tokens + 1) / 2
        kv_read = batch * self.kv_bytes_per_token * mean_len
        bytes_step = self.weight_bytes + kv_read
        flops_step = 2 * self.matmul_params * batch + 4 * batch * self.layers * self.heads * self.head_dim * mean_len
        intensity = flops_step / bytes_step
        achieved = bytes_step / step
        t_bytes = bytes_step / roof["copy_bandwidth"]
        t_flops = flops_step / roof["matmul_flops"] if roof.get("matmul_flops") else None
        mode = "CUDA graph per step" if graph_used else self.decode_mode
        layers: dict[str, Any] = {}
        if self.kernels is not None and not self.compiled:
            if self._fused is not None:
                layers["layers"] = "fused, one compiled call per layer"
                if self.fused_huge_fraction is not None:
                    layers["packed_on_huge_pages"] = round(self.fused_huge_fraction, 3)
            else:
                layers["layers"] = "per-op (transformers' modules)" + (f": {self.fused_note}" if self.fused_note else "")
        return SpeedPoint(
            **point, status="ok", decode_mode=mode,
            decode_path={"steps": mode, "weights": ("as loaded" if not packed else "packed once (gqakit panels)" if self.kernels is not None
                                      else "packed once (oneDNN)"),
                         "attention_kernel": self.decode_kernel,
                         **layers,
                         "prefill": "every repetition" if len(pre) >= reps else
                         "once, decode repetitions rewind the cache"},
            decode_samples=len(dec), decode_sample="one step" if len(dec) > reps else "mean step of a repetition",
            prefill_ms={"median": 1e3 * statistics.median(pre), "p90": 1e3 * percentile(pre, 90)},
            prefill_samples=len(pre),
            decode_ms_per_token={"median": 1e3 * step, "p90": 1e3 * percentile(dec, 90)},
            tokens_per_s={"median": batch / step, "p90_of_step_time": batch / percentile(dec, 90)},
            warmup_s=warm, compile_s=compile_s, reps=reps, packed_weight_bytes=packed,
            peak_memory_bytes=peak,
            peak_memory_kind="cuda max_memory_allocated" if self.device.type == "cuda" else "process peak RSS",
            kv_cache_bytes=kv_bytes,
            kv_cache_bytes_analytic=batch * (prompt_len + new_tokens) * self.kv_bytes_per_token,
            bytes_per_step={"weights": self.weight_bytes, "kv": kv_read, "total": bytes_step},
            flops_per_step=flops_step,
            roofline_ms={"bytes": 1e3 * t_bytes, "flops": None if t_flops is None else 1e3 * t_flops},
            achieved_bandwidth_gbs=achieved / 1e9,
            roofline_fraction=achieved / roof["copy_bandwidth"],
            arithmetic_intensity=intensity,
            memory_bound=intensity < roof["ridge_flops_per_byte"],
        )

    def run_point(self, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int,
                  roof: dict[str, float], *, prefill_once: bool = False) -> SpeedPoint:
        st = self.open_point(batch, prompt_len, new_tokens, warmup, prefill_once=prefill_once)
        if "result" in st:
            return st["result"]
        try:
            for _ in range(reps):
                self.rep(st)
        except BaseException as e:
            st["stack"].close()
            if type(e).__name__ == "OutOfMemoryError":
                import torch

                torch.cuda.empty_cache()
                return SpeedPoint(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, status="oom",
                                  reason="torch.OutOfMemoryError")
            raise
        return self.close_point(st, roof)


def huge_page_bytes() -> int | None:
    """This process's anonymous memory on transparent huge pages (Linux), or None."""
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def parse_ints(text: str, name: str) -> tuple[int, ...]:
    """'1,8,32' -> (1, 8, 32), with a one-line error for anything else."""
    try:
        vals = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise GqakitError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise GqakitError(f"{name} must be positive integers, got {text!r}")
    return vals


def evaluate_speed(model: Any, settings: SpeedSettings, *, device: Any, dtype: Any,
                   max_positions: int | None = None, progress: bool = True) -> SpeedResult:
    """The whole decode benchmark: roofs, attention path, grid, and max batch per prompt length."""
    import torch

    _check_settings(settings, max_positions)
    if settings.compile and torch.device(device).type != "cuda":
        tqdm.write("gqakit: note: --compile on the CPU needs a C++ compiler and compiles each model once per grid "
                   "point (about a minute each on 2 cores); the compile time is reported apart")
    # The fast path unless --eager: CUDA graphs on a GPU (checked token for token against the
    # eager step, eager again if capture fails), weights packed once on the CPU, and the
    # grouped matmul decode attention. --eager is the plain transformers step (SDPA).
    fast = not settings.eager
    if progress and fast and not settings.compile and torch.device(device).type == "cpu" and dtype == torch.float32:
        from gqakit.eval import cpu_kernels

        if not cpu_kernels.is_built() and not os.environ.get("GQAKIT_NO_CPU_KERNELS"):
            tqdm.write("gqakit: compiling the CPU decode kernels once for this machine (about 30 s; cached)")
    bench = DecodeBench(model, device=device, dtype=dtype, compile=settings.compile,
                        cuda_graphs=fast and not settings.compile and torch.device(device).type == "cuda",
                        pack_weights=fast, decode_kernel="matmul" if fast else "sdpa")
    bw = copy_bandwidth(device)
    fl = matmul_flops(device, dtype)
    roof = {"copy_bandwidth": bw, "matmul_flops": fl, "ridge_flops_per_byte": fl / bw}
    attention = bench.probe()
    grid = []
    points = [(b, p) for p in settings.prompt_lens for b in settings.batches]
    for b, p in tqdm(points, desc="decode grid", unit="point", disable=not progress):
        grid.append(bench.run_point(b, p, settings.new_tokens, settings.reps, settings.warmup, roof,
                                    prefill_once=settings.prefill_once))
    max_batch = []
    if settings.max_batch_search:
        for p in tqdm(settings.prompt_lens, desc="max batch", unit="len", disable=not progress):
            max_batch.append(bench.max_batch(p, settings.new_tokens, settings.max_batch_limit))
    return _speed_result(bench, settings, attention, roof, grid, max_batch)


def _check_settings(settings: SpeedSettings, max_positions: int | None) -> None:
    if settings.new_tokens < 1 or settings.reps < 1 or settings.warmup < 0:
        raise GqakitError("--new-tokens and --reps must be at least 1, --warmup at least 0")
    longest = max(settings.prompt_lens) + settings.new_tokens
    if max_positions is not None and longest > max_positions:
        raise GqakitError(f"prompt length + new tokens ({longest}) exceeds the model's {max_positions} positions")


def _speed_result(bench: DecodeBench, settings: SpeedSettings, attention: dict[str, Any], roof: dict[str, float],
                  grid: list[SpeedPoint], max_batch: list[MaxBatch], **extra_settings: Any) -> SpeedResult:
    import torch

    return SpeedResult(
        settings={"batches": list(settings.batches), "prompt_lens": list(settings.prompt_lens),
                  "new_tokens": settings.new_tokens, "reps": settings.reps, "warmup": settings.warmup,
                  "compile": settings.compile, "eager": settings.eager, "prefill_once": settings.prefill_once,
                  "torch_threads": torch.get_num_threads(), "prompts": "random token ids", **extra_settings},
        graph_error=bench.graph_error,
        attention=attention,
        device_roof={"copy_bandwidth_gbs": roof["copy_bandwidth"] / 1e9, "matmul_tflops": roof["matmul_flops"] / 1e12,
                     "ridge_flops_per_byte": roof["ridge_flops_per_byte"]},
        weight_bytes_per_step=bench.weight_bytes,
        kv_bytes_per_token=bench.kv_bytes_per_token,
        grid=grid,
        max_batch=max_batch,
    )


def run_points_alternating(benches: dict[str, DecodeBench], batch: int, prompt_len: int, new_tokens: int, reps: int,
                           warmup: int, *, prefill_once: bool = True) -> tuple[dict[str, SpeedPoint], dict[str, float]]:
    """One grid point of several models in one run: their decode steps alternate one by one
    (A B C, C B A, ...), so that the machine's drift (on a VM, memory speed that changes within
    minutes) hits every model alike and their ratios are measured, not inferred from separate
    runs. The roofs are measured after each repetition; their medians are the point's roof.
    Returns ({name: point}, roof)."""
    states = {n: b.open_point(batch, prompt_len, new_tokens, warmup, prefill_once=prefill_once)
              for n, b in benches.items()}
    live = [n for n in benches if "result" not in states[n]]
    first = next(iter(benches.values()))
    bws, fls = [], []
    try:
        for r in range(reps):
            order = live if r % 2 == 0 else live[::-1]
            for n in order:
                benches[n].begin_rep(states[n])
            for i in range(new_tokens):
                for n in (order if i % 2 == 0 else order[::-1]):
                    benches[n].decode_step(states[n])
            bws.append(copy_bandwidth(first.device))
            fls.append(matmul_flops(first.device, first.dtype))
    except BaseException:
        for n in live:
            if "stack" in states[n]:
                states[n]["stack"].close()
        raise
    bw, fl = statistics.median(bws), statistics.median(fls)
    roof = {"copy_bandwidth": bw, "matmul_flops": fl, "ridge_flops_per_byte": fl / bw}
    return {n: benches[n].close_point(states[n], roof) for n in benches}, roof


def evaluate_speed_together(models: dict[str, Any], settings: SpeedSettings, *, device: Any, dtype: Any,
                            max_positions: int | None = None, progress: bool = True) -> dict[str, SpeedResult]:
    """`evaluate_speed` for several loaded models at once, their steps alternating at every grid
    point (`run_points_alternating`): what `gqakit demo` uses, so that its report's speedups
    are ratios measured in one run. The fast path only (no --compile, --eager or max batch)."""
    import torch

    _check_settings(settings, max_positions)
    if settings.compile or settings.eager or settings.max_batch_search:
        raise GqakitError("timing models together supports the default fast path only")
    cuda = torch.device(device).type == "cuda"
    benches = {n: DecodeBench(m, device=device, dtype=dtype, cuda_graphs=cuda, pack_weights=True,
                              decode_kernel="matmul") for n, m in models.items()}
    attention = {n: b.probe() for n, b in benches.items()}
    grids: dict[str, list[SpeedPoint]] = {n: [] for n in benches}
    roofs = []
    points = [(b, p) for p in settings.prompt_lens for b in settings.batches]
    for b, p in tqdm(points, desc="decode grid (models alternating)", unit="point", disable=not progress):
        got, roof = run_points_alternating(benches, b, p, settings.new_tokens, settings.reps, settings.warmup,
                                           prefill_once=settings.prefill_once)
        roofs.append(roof)
        for n in benches:
            grids[n].append(got[n])
    bw = statistics.median(r["copy_bandwidth"] for r in roofs)
    fl = statistics.median(r["matmul_flops"] for r in roofs)
    roof = {"copy_bandwidth": bw, "matmul_flops": fl, "ridge_flops_per_byte": fl / bw}
    return {n: _speed_result(benches[n], settings, attention[n], roof, grids[n], [],
                             timed_with=list(models), timing="one run, the models' decode steps alternating one by one")
            for n in benches}
