"""Decode steps on a static KV cache: the public pieces the benchmark times.

As gpt-fast exposes `prefill` and `decode_one_token`, `DecodeSteps` exposes the steps of
one loaded model: `new_cache` (a pre-allocated `transformers.StaticCache`), `prefill`,
`decode_step` (one greedy token), `decode` (timed greedy steps), `capture_graph` (one
decode step as a CUDA graph) and `rewind` (the cache back to the prompt). Greedy tokens
stay on the device (no `.item()` per step, which would add a sync), and the device is
synchronized right before and after each timed region.

The decode attention kernel travels with the model (`decode.attention.set_decode_kernel`);
a decode step runs `fused` (the checked one-call-per-layer CPU step) when one is set, else
`step` (the model, or its `torch.compile`d form).
"""

from __future__ import annotations

import inspect
import time
from typing import Any, NamedTuple

from gqakit.core.loaded import loaded_shape
from gqakit.core.loading import cache_kwarg
from gqakit.runtime.attention import SdpaSpy, set_decode_kernel
from gqakit.eval.speed.roofline import sync


class CapturedStep(NamedTuple):
    """One decode step as a CUDA graph and its static buffers: token in, position in, logits out."""

    graph: Any
    tok: Any
    pos: Any
    logits: Any


class DecodeSteps:
    """Prefill and greedy decode steps of `model` on static caches (see the module docstring)."""

    def __init__(self, model: Any, *, device: Any, dtype: Any, decode_kernel: str = "matmul") -> None:
        import torch

        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.cache_kw = cache_kwarg(model)  # `cache` from transformers 5.24, else `past_key_values`
        self.cfg = model.config.get_text_config(decoder=True)
        self.shape = shape = loaded_shape(self.cfg)
        self.heads, self.kv_heads, self.head_dim, self.layers = (shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                                                 shape.num_layers)
        self.vocab = int(self.cfg.vocab_size)
        self.decode_kernel = decode_kernel
        sig = inspect.signature(model.forward).parameters
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in sig else {}
        self.step: Any = model       # what a decode step calls: the model, or its compiled form
        self.fused: Any = None       # a checked one-call-per-layer step (decode.layers.FusedDecode), or None

    def select_kernel(self) -> None:
        """Make the model decode with this object's kernel (another object may share the model)."""
        set_decode_kernel(self.model, self.decode_kernel)

    def new_cache(self, batch: int, max_len: int) -> Any:
        """A static cache of `max_len` positions for `batch` sequences, allocated now."""
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        heads = list(self.shape.kv_heads_per_layer or ()) or self.kv_heads  # each layer's own K/V heads
        cache.early_initialization(batch, heads, self.head_dim, self.dtype, self.device)
        return cache

    @staticmethod
    def rewind(cache: Any, length: int) -> None:
        """Make `cache` hold only its first `length` positions again (prompt kept, decode undone).

        Later slots keep stale values, but the causal mask hides every slot past the
        position being decoded, and each step writes its own slot before attending.
        """
        for layer in cache.layers:
            layer.cumulative_length.fill_(length)

    def prefill(self, cache: Any, prompt: Any) -> tuple[float, Any]:
        """The prompt through the model into `cache`: (seconds, first greedy token)."""
        import torch

        _, p = prompt.shape
        pos = torch.arange(p, device=self.device).unsqueeze(0)
        sync(self.device)
        t0 = time.perf_counter()
        logits = self.model(input_ids=prompt, **{self.cache_kw: cache}, position_ids=pos, use_cache=True,
                            **self.keep).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        sync(self.device)
        return time.perf_counter() - t0, tok

    def decode_step(self, cache: Any, tok: Any, position: int) -> Any:
        """One greedy decode step of `tok` ([B, 1]) at `position`: the next token, on the device."""
        import torch

        pos = torch.full((1, 1), position, device=self.device, dtype=torch.long)
        if self.fused is not None:
            out = self.fused(input_ids=tok, **{self.cache_kw: cache}, position_ids=pos)
        else:
            out = self.step(input_ids=tok, **{self.cache_kw: cache}, position_ids=pos, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def decode(self, cache: Any, tok: Any, start: int, new_tokens: int, *, graph: CapturedStep | None = None,
               tokens: list | None = None, first_step: list | None = None,
               spy: SdpaSpy | None = None) -> tuple[float, Any]:
        """`new_tokens` greedy decode steps from position `start`: (seconds, last token).

        With `graph` (from `capture_graph`), the steps are replays of it; `tokens`, when
        given, collects the greedy tokens (device tensors, no sync); `first_step`, when
        given, gets the wall time of the first step (where `torch.compile` compiles); with
        `spy`, the first step runs the eager model inside it, so it sees the attention calls.
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
            if spy is not None and i == 0:
                pos = torch.full((1, 1), start, device=self.device, dtype=torch.long)
                with spy:
                    out = self.model(input_ids=tok, **{self.cache_kw: cache}, position_ids=pos, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            elif spy is not None:
                pos = torch.full((1, 1), start + i, device=self.device, dtype=torch.long)
                out = self.step(input_ids=tok, **{self.cache_kw: cache}, position_ids=pos, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            else:
                tok = self.decode_step(cache, tok, start + i)
            if first_step is not None and i == 0:
                sync(self.device)
                first_step.append(time.perf_counter() - t1)
        sync(self.device)
        return time.perf_counter() - t1, tok

    def generate(self, cache: Any, prompt: Any, new_tokens: int, *, graph: CapturedStep | None = None,
                 tokens: list | None = None, spy: SdpaSpy | None = None) -> tuple[float, float]:
        """Prefill + `new_tokens` decode steps; returns (prefill s, decode s)."""
        pre, tok = self.prefill(cache, prompt)
        dec, _ = self.decode(cache, tok, prompt.shape[1], new_tokens, graph=graph, tokens=tokens, spy=spy)
        return pre, dec

    def capture_graph(self, cache: Any, batch: int) -> CapturedStep:
        """One decode step on `cache` as a CUDA graph.

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
            return self.model(input_ids=tok, **{self.cache_kw: cache}, position_ids=pos, use_cache=True,
                              **self.keep).logits

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
        return CapturedStep(graph, tok, pos, logits)
