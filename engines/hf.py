"""The `transformers` engine: stock transformers as a plain Hugging Face user runs it.

`generate` is `model.generate` (greedy, a static cache, the model's own attention: SDPA
where transformers has it), with no stop token and no logits processor, so every prompt
gets exactly `max_new_tokens` argmax tokens. `time_point` times the same modules step by
step on a static cache (prefill, then one forward per new token). `kv_allocation` reads the
bytes of the static cache transformers allocates for `max_len` tokens, layer by layer (a sliding-window layer's holds its window, where that is shorter).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from gqakit.core.errors import GqakitError
from gqakit.engines.base import EngineOptions, Generation, KvAllocation, PointTiming


@contextmanager
def no_stop_token(model: Any) -> Iterator[None]:
    """`generate` without the model's stop token: transformers fills a setting the call leaves
    unset from the model's own generation config, so the token is taken off it while it runs."""
    gc = model.generation_config
    was = gc.eos_token_id
    gc.eos_token_id = None
    try:
        yield
    finally:
        gc.eos_token_id = was


class TransformersEngine:
    name: ClassVar[str] = "transformers"
    formats: ClassVar[tuple[str, ...]] = ("folder", "gguf")

    def __init__(self) -> None:
        self.model: Any = None
        self.options = EngineOptions()

    # -- loading ------------------------------------------------------------------------
    def load(self, model: Path, options: EngineOptions) -> None:
        from gqakit.core.loading import load_causal_lm

        self.options = options
        path = Path(model)
        if options.gguf_file and path.is_dir():
            path = path / options.gguf_file
        self.model = load_causal_lm(path, dtype=self.torch_dtype(path), device="cpu", progress=False)
        self.prepare()

    def torch_dtype(self, path: Path) -> Any:
        """The dtype named by the options; auto: the model's saved dtype (float32 when it names none)."""
        import torch

        from gqakit.core.loading import read_config_json, split_source
        from gqakit.core.units import config_dtype, torch_dtype

        if self.options.dtype != "auto":
            return torch_dtype(self.options.dtype)
        folder, gguf = split_source(path)
        saved = None if gguf else config_dtype(read_config_json(folder))
        return torch_dtype(saved) if saved else torch.float32

    def prepare(self) -> None:
        """What the engine does to the loaded model before it runs (the gqakit engine switches
        attention here); the transformers engine keeps the model as loaded."""
        if self.options.threads:
            import torch

            torch.set_num_threads(self.options.threads)

    def loaded(self) -> Any:
        if self.model is None:
            raise GqakitError(f"the {self.name} engine has no model loaded")
        return self.model

    # -- greedy generation --------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generation:
        """Greedy ids and their log-probs, prompts of one length batched together."""
        import torch
        from transformers import GenerationConfig

        model = self.loaded()
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                  eos_token_id=None, pad_token_id=0, cache_implementation="static",
                                  return_dict_in_generate=True, output_logits=True)
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        start = time.perf_counter()
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        for length, idx in by_len.items():
            for lo in range(0, len(idx), self.options.max_batch):
                chunk = idx[lo:lo + self.options.max_batch]
                ids = torch.tensor([prompts[i] for i in chunk], dtype=torch.long)
                with torch.inference_mode(), no_stop_token(model):
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
                new = out.sequences[:, length:]
                lp = torch.stack([torch.log_softmax(x.float(), dim=-1) for x in out.logits], dim=1)
                picked = lp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
                for row, i in enumerate(chunk):
                    tokens[i] = new[row].tolist()
                    logprobs[i] = picked[row].tolist()
        return Generation(tokens=tokens, logprobs=logprobs, seconds=time.perf_counter() - start)

    # -- timing -------------------------------------------------------------------------
    def time_point(self, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int) -> PointTiming:
        """Prefill of `batch` random prompts of `prompt_len` tokens, then `new_tokens` greedy
        steps, each timed, on one static cache reset between repetitions."""
        import torch
        from transformers import StaticCache

        from gqakit.core.loading import cache_kwarg

        model = self.loaded()
        kw = cache_kwarg(model)
        vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (batch, prompt_len), generator=gen)
        cache = StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
        pre: list[float] = []
        dec: list[float] = []
        with torch.inference_mode():
            for r in range(warmup + reps):
                cache.reset()
                t0 = time.perf_counter()
                out = model(input_ids=prompt, **{kw: cache}, use_cache=True,
                            cache_position=torch.arange(prompt_len))
                tok = out.logits[:, -1:].argmax(-1)
                t1 = time.perf_counter()
                steps = []
                for i in range(new_tokens):
                    s0 = time.perf_counter()
                    out = model(input_ids=tok, **{kw: cache}, use_cache=True,
                                cache_position=torch.tensor([prompt_len + i]))
                    tok = out.logits[:, -1:].argmax(-1)
                    steps.append(time.perf_counter() - s0)
                if r >= warmup:
                    pre.append(t1 - t0)
                    dec += steps
        return PointTiming(prefill_s=pre, decode_s=dec)

    # -- the KV cache it allocates ------------------------------------------------------
    def kv_allocation(self) -> KvAllocation:
        """The bytes of the static cache transformers allocates for one sequence of `max_len`
        tokens: every layer's key and value tensors, as allocated (not as predicted)."""
        import torch
        from transformers import StaticCache

        from gqakit.core.loading import cache_kwarg

        model = self.loaded()
        length = self.options.max_len
        cache = StaticCache(config=model.config, max_cache_len=length)
        with torch.inference_mode():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long), **{cache_kwarg(model): cache}, use_cache=True,
                  cache_position=torch.arange(1))
        per_layer = [int(layer.keys.nbytes + layer.values.nbytes) for layer in cache.layers]
        total = sum(per_layer)
        dtype = str(cache.layers[0].keys.dtype).removeprefix("torch.")
        return KvAllocation(bytes_per_token=total // length, capacity_tokens=length, total_bytes=total,
                            detail={"cache": "transformers StaticCache", "cache_dtype": dtype, "layers": len(per_layer),
                                    "kv_heads_per_layer": [int(layer.keys.shape[1]) for layer in cache.layers],
                                    # a sliding layer's cache holds min(window, max_len) positions
                                    "positions_per_layer": [int(layer.keys.shape[-2]) for layer in cache.layers]})

    def close(self) -> None:
        self.model = None
