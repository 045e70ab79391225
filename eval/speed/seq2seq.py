"""Decode speed of an encoder-decoder (T5, mT5, BART, Whisper and gqakit's grouped versions of them).

A grid point is batch x input length x output length. When it opens, the encoder reads a
random input once (token ids, or audio features whose length is in frames: `encoder_input`);
the decoder prefix (the start token and `output_len - 1` random tokens) goes through the
decoder in one call, which fills the cross-attention cache (K and V of the
encoder's output, every decoder layer) and the self-attention cache. Then `new_tokens`
greedy decode steps are timed; each reads both caches. Repetitions rewind the
self-attention cache to the prefix; the cross-attention cache, like the encoder's output, is
made once per point. The two caches are transformers' `EncoderDecoderCache` of two
`StaticCache`s, allocated before any timed step.

The step is the model's own (its modules, transformers' cache); the fused decoder-only
layers of `runtime` do not cover encoder-decoders, and `decode_path` says which path
ran. Unless `eager`: attention is transformers' SDPA function with one query token always
folded per KV head (`decode.attention.folded_sdpa_forward`; transformers alone hands the
unmasked cross-attention to SDPA's slower `enable_gqa`), and on the CPU in fp32 the linear
layers multiply by once-packed weights (gqakit's panel GEMM).

A step reads the decoder's weights (those of the modules it calls: the cross-attention's K
and V projections are not called, an embedding lookup reads only B rows), the
self-attention cache up to the output position and the whole cross-attention cache:
2 x decoder layers x KV heads x head size x input length x bytes per sequence
(`core.arch.Seq2SeqShape.cache_bytes`). `eval.speed.roofline.predict_speedup` turns two
models' bytes into the predicted speedup, as for decoder-only models.
"""

from __future__ import annotations

import time
from typing import Any

from gqakit.core.loaded import loaded_seq2seq_shape
from gqakit.core.device import PeakMemory, available_memory
from gqakit.core.errors import GqakitError, first_line
from gqakit.core.loading import cache_kwarg
from gqakit.runtime.attention import SdpaSpy, describe_path, use_folded_attention
from gqakit.eval.records import SpeedPoint, SpeedResult
from gqakit.eval.speed.encoder_input import encoder_input
from gqakit.eval.speed.point import PointCost, summarize, timings
from gqakit.eval.speed.roofline import measure_roof, sync
from gqakit.eval.speed.seq2seq_point import CACHES, Seq2SeqPoint
from gqakit.eval.speed.settings import SpeedSettings

# Encoder rows run together so that one layer's attention scores stay under this many bytes.
ENCODER_SCORE_BYTES = 1 << 30
LAYERS = "the model's own decoder step (the fused decoder-only layers do not cover encoder-decoders)"
LEAN = ("the lean T5 decoder step (runtime/t5_step.py: the model's weights and caches as plain tensor "
        "operations, checked against the model's own step)")
LEAN_FUSED = ("the lean T5 decoder step, one compiled call per block (runtime/t5_step.py, "
              "cpu_kernels.cpp's t5_decode_layer; checked against the model's own step)")


class Seq2SeqBench:
    """Times the decoder steps of one loaded encoder-decoder (see the module docstring).

    Its grid-point methods are those of `DecodeBench` (`open_point`, `begin_rep`,
    `timed_step`, `close_point`, `run_point`, with the output length as a keyword), so
    `grid.run_points_alternating` alternates two encoder-decoders' steps as it does two
    decoders'.
    """

    def __init__(self, model: Any, *, device: Any, dtype: Any, pack_weights: bool = True,
                 fold_attention: bool = True) -> None:
        import torch

        from gqakit.runtime.packed import can_pack

        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.cache_kw = cache_kwarg(model)
        self.shape, self.input = loaded_seq2seq_shape(model.config), encoder_input(model)
        dec = self.shape.decoder
        self.heads, self.kv_heads, self.head_dim, self.layers = (dec.num_heads, dec.num_kv_heads, dec.head_dim,
                                                                 dec.num_layers)
        self.elem = torch.finfo(dtype).bits // 8
        self.vocab = int(model.config.vocab_size)
        start = getattr(model.config, "decoder_start_token_id", None)
        self.start = 0 if start is None else int(start)
        # K and V of every decoder layer: per output token (self-attention), per input token (cross-attention)
        self.kv_bytes_per_token, self.kv_bytes_per_input_token = self.shape.cache_bytes(
            self.elem, input_tokens=1, output_tokens=1)
        self.pack_weights = bool(pack_weights) and can_pack(self.device, dtype)
        self.kernels = None
        self.kernel_note: str | None = None
        if self.pack_weights and dtype == torch.float32:
            from gqakit.runtime import kernels as cpu_kernels

            self.kernels = cpu_kernels.load()
            if self.kernels is None:
                self.kernel_note = f"gqakit CPU kernels unavailable ({cpu_kernels.why_unavailable()})"
        if fold_attention:  # one query token always folded per KV head (decode.attention.folded_sdpa_forward)
            self.attn_impl = use_folded_attention(model)
        else:
            self.attn_impl = str(getattr(model.config, "_attn_implementation", None) or "unknown")
        # The lean T5 step (runtime/t5_step.py) where it applies and agrees with the model's own;
        # the weights a step reads are found on the model's own step, which calls the same modules.
        self.lean, self.lean_note = None, "off (eager)" if not fold_attention else None
        self.weight_bytes, self.matmul_params = self.step_weights()
        if fold_attention:
            self.lean, self.lean_note = self._lean_step()

    def _lean_step(self) -> tuple[Any, str | None]:
        from gqakit.runtime.t5_step import T5Step, check_t5_step, t5_layout_problem

        why = t5_layout_problem(self.model)
        if why is not None:
            return None, why
        step = T5Step(self.model, kernels=self.kernels)
        why = check_t5_step(self.model, step, self.new_cache, self.vocab, self.start, cache_kw=self.cache_kw)
        return (None, why) if why is not None else (step, None)

    # -- limits and the path --------------------------------------------------------------
    def positions(self) -> tuple[int | None, int | None]:
        """(input, output) positions the model has: none for T5's relative position buckets,
        which have no length limit; learned positions (BART) stop at their table's size."""
        if getattr(self.model.config, "relative_attention_num_buckets", None):
            return None, None
        if self.input.features:  # frames: the longest input the encoder takes
            return self.input.max_frames, self.shape.decoder.max_positions
        return self.shape.encoder.max_positions, self.shape.decoder.max_positions

    @property
    def layers_mode(self) -> str:
        if self.lean is not None:
            if self.lean.kernels is not None:
                return LEAN_FUSED
            return LEAN + (f" (one compiled call per block does not apply: {self.lean.fused_note})"
                           if self.kernels is not None else "")
        return LAYERS + (f" (the lean T5 step does not apply: {self.lean_note})" if self.lean_note else "")

    @property
    def decode_mode(self) -> str:
        step = "the lean T5 decoder step" if self.lean is not None else "the model's own decoder step"
        if self.kernels is not None:
            return f"eager, {step}, gqakit CPU kernels (panel GEMM)"
        return f"eager, {step}" + (", weights packed (oneDNN)" if self.pack_weights else "")

    # -- the steps ------------------------------------------------------------------------
    def new_cache(self, output_positions: int, input_len: int) -> Any:
        """Both caches (`input_len`: encoder output positions); their tensors are allocated by the prefix call."""
        from transformers import EncoderDecoderCache, StaticCache

        cfg = self.model.config.get_text_config(decoder=True)
        return EncoderDecoderCache(StaticCache(config=cfg, max_cache_len=output_positions),
                                   StaticCache(config=cfg, max_cache_len=input_len))

    @staticmethod
    def rewind(cache: Any, length: int) -> None:
        """The self-attention cache back to its first `length` positions (the cross-attention cache stays).

        Later slots keep stale values, hidden by the causal mask; each step writes its slot first."""
        for layer in cache.self_attention_cache.layers:
            layer.cumulative_length.fill_(length)

    def encode(self, input_ids: Any) -> tuple[float, Any]:
        """The encoder over `input_ids` ([B, input length], or features [B, bins, frames]): (seconds,
        its output). Rows run in chunks that keep one layer's attention scores under ENCODER_SCORE_BYTES."""
        import torch
        from transformers.modeling_outputs import BaseModelOutput

        b, n = input_ids.shape[0], self.input.positions(input_ids.shape[-1])
        rows = max(1, min(b, ENCODER_SCORE_BYTES // max(1, self.shape.encoder.num_heads * n * n * 4)))
        encoder = self.model.get_encoder()
        sync(self.device)
        t0 = time.perf_counter()
        try:
            hidden = torch.cat([encoder(**{self.input.name: input_ids[i:i + rows]}).last_hidden_state
                                for i in range(0, b, rows)])
        except ValueError as e:  # a length the encoder does not take (Whisper's: only its whole window)
            raise GqakitError(f"the encoder refuses an input of {input_ids.shape[-1]} {self.input.unit}: "
                              f"{first_line(e)}") from None
        sync(self.device)
        return time.perf_counter() - t0, BaseModelOutput(last_hidden_state=hidden)

    def decoder_call(self, cache: Any, encoded: Any, tokens: Any) -> Any:
        """The model's decoder on `tokens` ([B, T]) against `encoded`, through `cache`: the next greedy tokens."""
        out = self.model(encoder_outputs=encoded, decoder_input_ids=tokens, **{self.cache_kw: cache}, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def step_call(self, cache: Any, encoded: Any, tok: Any) -> Any:
        """One decode step after the prefix (both caches filled): the lean T5 step where it applies."""
        if self.lean is not None:
            return self.lean(tok, cache).logits[:, -1].argmax(-1, keepdim=True)
        return self.decoder_call(cache, encoded, tok)

    def prefill(self, cache: Any, encoded: Any, output_len: int) -> tuple[float, Any]:
        """The decoder prefix (start token + random tokens, `output_len` in all): (seconds, first greedy token)."""
        import torch

        b = encoded.last_hidden_state.shape[0]
        prefix = torch.randint(0, self.vocab, (b, output_len), device=self.device)
        prefix[:, 0] = self.start
        sync(self.device)
        t0 = time.perf_counter()
        tok = self.decoder_call(cache, encoded, prefix)
        if self.lean is not None:
            self.lean.prepare(cache)  # the cross-attention keys laid out for the compiled block, once
        sync(self.device)
        return time.perf_counter() - t0, tok

    def steps(self, cache: Any, encoded: Any, tok: Any, n: int, *, tokens: list | None = None) -> tuple[float, Any]:
        """`n` greedy decode steps from `tok`: (seconds, last token); `tokens` collects them."""
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            if tokens is not None:
                tokens.append(tok)
            tok = self.step_call(cache, encoded, tok)
        sync(self.device)
        return time.perf_counter() - t0, tok

    def generate(self, input_ids: Any, output_len: int, new_tokens: int) -> Any:
        """Encoder, prefix and `new_tokens` steps on fresh caches: the greedy tokens after the prefix, [B, new_tokens]."""
        import torch

        with torch.inference_mode():
            cache = self.new_cache(output_len + new_tokens, self.input.positions(input_ids.shape[-1]))
            _, encoded = self.encode(input_ids)
            _, tok = self.prefill(cache, encoded, output_len)
            got: list = []
            self.steps(cache, encoded, tok, new_tokens, tokens=got)
        return torch.cat(got, 1)

    def step_weights(self) -> tuple[int, int]:
        """(bytes, matmul parameters) of the weights one decode step reads, found by running one:
        the parameters of every module it calls, except an embedding's (a lookup reads B rows)
        unless a called module multiplies by them too (a tied LM head)."""
        import torch

        called: list[Any] = []
        hooks = [m.register_forward_pre_hook(lambda mod, args: called.append(mod)) for m in self.model.modules()]
        try:
            with torch.inference_mode():
                cache, encoded = self.probe_encoded()
                _, tok = self.prefill(cache, encoded, 1)
                called.clear()
                self.steps(cache, encoded, tok, 1)
        finally:
            for h in hooks:
                h.remove()
        read: dict[int, Any] = {}
        matmul: dict[int, Any] = {}
        for m in dict.fromkeys(called):
            if isinstance(m, torch.nn.Embedding):
                continue
            for p in m.parameters(recurse=False):
                read[id(p)] = p
            if isinstance(m, torch.nn.Linear):
                matmul[id(m.weight)] = m.weight
        return (sum(p.numel() * p.element_size() for p in read.values()),
                sum(p.numel() for p in matmul.values()))

    def probe_encoded(self) -> tuple[Any, Any]:
        """Caches and an encoder output of one short constant input, for the one-step probes."""
        n = self.input.probe_len
        x = self.input.constant(1, n, token=self.start, device=self.device, dtype=self.dtype)
        return self.new_cache(2, self.input.positions(n)), self.encode(x)[1]

    def probe(self) -> dict[str, Any]:
        """Which attention path a decode step takes (one step, SDPA calls recorded)."""
        import torch

        spy = SdpaSpy()
        with torch.inference_mode():
            cache, encoded = self.probe_encoded()
            _, tok = self.prefill(cache, encoded, 1)
            with spy:
                self.steps(cache, encoded, tok, 1)
        if self.lean is not None and self.lean.kernels is not None:
            # inside the compiled block: no SDPA call to see; its attention reads the caches in place
            path = ("MHA: one K/V head per query head" if self.kv_heads == self.heads else
                    "grouped fused CPU kernel decode attention: query heads as rows of their K/V head (packed GQA), "
                    "inside the compiled T5 block")
            own = cross = {"decode_path": path, "kv_copied": False, "sdpa_calls_per_step": 0, "decode_kernel": "cpu"}
        else:  # a decoder layer attends to itself, then to the encoder's output
            own, cross = (describe_path(spy.calls[i::2], self.heads, self.kv_heads) for i in (0, 1))
        copied = [d["kv_copied"] for d in (own, cross)]
        return {"implementation": self.attn_impl,
                "decode_path": f"self-attention: {own['decode_path']}; cross-attention: {cross['decode_path']}",
                "kv_copied": True if True in copied else None if None in copied else False,
                "sdpa_calls_per_step": len(spy.calls), "self_attention": own, "cross_attention": cross,
                "kv_cache": CACHES, "layers": self.layers_mode, "compiled": False, "cuda_graphs": False,
                **({"kernel_note": self.kernel_note} if self.kernel_note else {})}

    # -- memory model ---------------------------------------------------------------------
    def predicted_bytes(self, batch: int, input_len: int, output_len: int, new_tokens: int) -> int:
        """Memory a point adds beyond the weights: both caches, the encoder's activations (one
        chunk's scores), its output, and the prefix's logits."""
        input_len = self.input.positions(input_len)  # encoder output positions
        caches = batch * (input_len * self.kv_bytes_per_input_token + (output_len + new_tokens) * self.kv_bytes_per_token)
        hidden = self.shape.encoder.hidden_size
        heads = self.shape.encoder.num_heads
        scores = min(batch * heads * input_len * input_len * 4, max(ENCODER_SCORE_BYTES, heads * input_len ** 2 * 4))
        act = batch * input_len * hidden * 4 * 16
        logits = batch * output_len * self.vocab * 4
        return caches + 2 * scores + act + logits

    # -- one grid point -------------------------------------------------------------------
    def open_point(self, batch: int, prompt_len: int, new_tokens: int, warmup: int, *, prefill_once: bool = True,
                   output_len: int = 1) -> Seq2SeqPoint:
        """Set up one point (`prompt_len`: the input length): caches, packed weights, the
        encoder and the decoder prefix once, warm-up steps. Its `result` is set when it does
        not fit. (`prefill_once` is accepted for `DecodeBench`'s signature: the prefix always
        runs once per point.)"""
        import torch

        pt = Seq2SeqPoint(batch, prompt_len, new_tokens, output_len=output_len)
        if self.device.type != "cuda":
            need, avail = self.predicted_bytes(batch, prompt_len, output_len, new_tokens), available_memory(self.device)
            if need > 0.8 * avail:
                pt.result = SpeedPoint(**pt.axes, status="oom", reason=f"predicted {need / 2**30:.2f} GiB > 80% of "
                                       f"{avail / 2**30:.2f} GiB available")
                return pt
        pt.peak = PeakMemory(self.device)
        try:
            with torch.inference_mode():
                self._open(pt, warmup)
            return pt
        except torch.OutOfMemoryError:
            pt.stack.close()
            torch.cuda.empty_cache()
            return Seq2SeqPoint(batch, prompt_len, new_tokens, output_len=output_len,
                                result=SpeedPoint(**pt.axes, status="oom", reason="torch.OutOfMemoryError"))
        except BaseException:
            pt.stack.close()
            raise

    def _open(self, pt: Seq2SeqPoint, warmup: int) -> None:
        import torch

        from gqakit.runtime.packed import packed_linears

        pt.cache = self.new_cache(pt.output_len + pt.new_tokens, self.input.positions(pt.prompt_len))
        if self.lean is not None and self.lean.kernels is not None:
            pt.packed_bytes = self.lean.packed_bytes  # the fused step's own packed weights; prefill as loaded
        elif self.pack_weights and (pt.batch > 1 or self.kernels is not None):
            order = self.lean.linears() if self.lean is not None else None
            pt.packed_bytes = pt.stack.enter_context(packed_linears(self.model, pt.batch, kernels=self.kernels,
                                                                    order=order))
        inputs = self.input.random(pt.batch, pt.prompt_len, vocab=self.vocab, device=self.device, dtype=self.dtype)
        pt.encode_s, pt.encoded = self.encode(inputs)
        pre, pt.tok = self.prefill(pt.cache, pt.encoded, pt.output_len)
        pt.first_s = pt.encode_s + pre
        pt.pre.append(pt.first_s)
        pt.rewind = True
        pt.kv_bytes = sum(t.numel() * t.element_size() for c in (pt.cache.self_attention_cache,
                                                                 pt.cache.cross_attention_cache)
                          for layer in c.layers if getattr(layer, "is_initialized", False)
                          for t in (layer.keys, layer.values))
        t0 = time.perf_counter()
        for _ in range(warmup):
            self.rewind(pt.cache, pt.output_len)
            self.steps(pt.cache, pt.encoded, pt.tok, pt.new_tokens)
        pt.warmup_s = time.perf_counter() - t0
        pt.peak.reset()

    def rep(self, pt: Seq2SeqPoint) -> None:
        """One timed repetition: the self-attention cache rewound to the prefix, `new_tokens` steps."""
        import torch

        with torch.inference_mode():
            self.rewind(pt.cache, pt.output_len)
            d, _ = self.steps(pt.cache, pt.encoded, pt.tok, pt.new_tokens)
        pt.dec.append(d / pt.new_tokens)
        pt.reps += 1

    def begin_rep(self, pt: Seq2SeqPoint) -> None:
        """Start a repetition step by step (see `timed_step`)."""
        import torch

        with torch.inference_mode():
            self.rewind(pt.cache, pt.output_len)
        pt.tok0, pt.i = pt.tok, 0
        pt.reps += 1

    def timed_step(self, pt: Seq2SeqPoint) -> float:
        """One timed decode step of the current repetition, recorded as a sample."""
        import torch

        with torch.inference_mode():
            d, pt.cur = self.steps(pt.cache, pt.encoded, pt.cur if pt.i else pt.tok0, 1)
        pt.i += 1
        pt.dec.append(d)
        return d

    def close_point(self, pt: Seq2SeqPoint, roof: dict[str, float]) -> SpeedPoint:
        """Release an open point and return its measurements."""
        if pt.result is not None:
            return pt.result
        peak = pt.peak.peak()
        pt.stack.close()
        pt.cache = pt.encoded = pt.tok = pt.tok0 = pt.cur = None
        pt.result = summarize(self, pt, roof, peak=peak)
        return pt.result

    def point_cost(self, pt: Seq2SeqPoint) -> PointCost:
        """The bytes a step must read: the decoder's weights, the self-attention cache at the
        output position (mean over the steps) and the whole cross-attention cache."""
        batch, input_len = pt.batch, self.input.positions(pt.prompt_len)  # cross-attention positions
        mean_out = pt.output_len + (pt.new_tokens + 1) / 2
        self_kv = batch * self.kv_bytes_per_token * mean_out
        cross_kv = batch * self.kv_bytes_per_input_token * input_len
        total = self.weight_bytes + self_kv + cross_kv
        flops = (2 * self.matmul_params * batch
                 + 4 * batch * self.layers * self.heads * self.head_dim * (mean_out + input_len))
        return PointCost(bytes={"weights": self.weight_bytes, "kv": self_kv + cross_kv, "self_attention_kv": self_kv,
                                "cross_attention_kv": cross_kv, "total": total}, flops=flops,
                         kv_analytic=batch * (input_len * self.kv_bytes_per_input_token
                                              + (pt.output_len + pt.new_tokens) * self.kv_bytes_per_token))

    def point_path(self, pt: Seq2SeqPoint, graph_used: bool) -> tuple[str, dict[str, Any]]:
        """The decode mode of a closed point, and which path each part of its step took."""
        weights = ("as loaded" if not pt.packed_bytes else "packed once (oneDNN)" if self.kernels is None
                   else "packed once (gqakit panels, one huge-page buffer in the step's order)"
                   if self.lean is not None else "packed once (gqakit panels)")
        return self.decode_mode, {
            "steps": self.decode_mode, "weights": weights, "attention": self.attn_impl, "layers": self.layers_mode,
            "caches": CACHES, "prefill": "once per point (encoder, then the decoder prefix); decode repetitions "
                                         "rewind the self-attention cache"}

    def prefill_fields(self, pt: Seq2SeqPoint) -> dict[str, Any]:
        """Time to the first token (encoder and decoder prefix, once per point), the encoder's
        time, and the decode timings."""
        return {"prefill_ms": {"median": 1e3 * pt.first_s, "p90": 1e3 * pt.first_s}, "prefill_samples": 1,
                "encode_ms": {"median": 1e3 * pt.encode_s, "p90": 1e3 * pt.encode_s}, **timings(pt.batch, [], pt.dec)}

    def run_point(self, batch: int, input_len: int, output_len: int, new_tokens: int, reps: int, warmup: int,
                  roof: dict[str, float]) -> SpeedPoint:
        """One grid point, start to end: open, `reps` repetitions, close."""
        pt = self.open_point(batch, input_len, new_tokens, warmup, output_len=output_len)
        if pt.result is not None:
            return pt.result
        try:
            for _ in range(reps):
                self.rep(pt)
        except BaseException:
            pt.stack.close()
            raise
        return self.close_point(pt, roof)


def evaluate_speed_seq2seq(model: Any, settings: SpeedSettings, *, device: Any, dtype: Any,
                           progress: bool = True) -> SpeedResult:
    """The decode benchmark of one encoder-decoder over batch x input length x output length."""
    import torch
    from tqdm.auto import tqdm

    settings.check_model(True)
    bench = Seq2SeqBench(model, device=device, dtype=dtype, pack_weights=not settings.plain,
                         fold_attention=not settings.plain)
    bench.engine = settings.engine
    if bench.input.features and "input_lens" not in settings.model_fields_set:  # the encoder's whole window
        settings = settings.model_copy(update={"input_lens": (bench.input.max_frames,)})
    settings.check_seq2seq_positions(*bench.positions())
    roof = measure_roof(device, dtype)
    attention = bench.probe()
    points = [(b, i, o) for i in settings.input_lens for o in settings.output_lens for b in settings.batches]
    grid = [bench.run_point(b, i, o, settings.new_tokens, settings.reps, settings.warmup, roof)
            for b, i, o in tqdm(points, desc="decode grid", unit="point", disable=not progress)]
    return SpeedResult(
        settings={"batches": list(settings.batches), "input_lens": list(settings.input_lens),
                  "output_lens": list(settings.output_lens), "new_tokens": settings.new_tokens,
                  "reps": settings.reps, "warmup": settings.warmup, "eager": settings.eager,
                  "torch_threads": torch.get_num_threads(),
                  "prompts": "random token ids (input and decoder prefix)" if not bench.input.features
                  else f"random audio features (input lengths in {bench.input.unit}), random decoder prefix",
                  "encoder": "once per point", "engine": settings.engine},
        attention=attention,
        device_roof={"copy_bandwidth_gbs": roof["copy_bandwidth"] / 1e9, "matmul_tflops": roof["matmul_flops"] / 1e12,
                     "ridge_flops_per_byte": roof["ridge_flops_per_byte"]},
        weight_bytes_per_step=bench.weight_bytes,
        kv_bytes_per_token=bench.kv_bytes_per_token,
        kv_bytes_per_input_token=bench.kv_bytes_per_input_token,
        grid=grid,
    )
