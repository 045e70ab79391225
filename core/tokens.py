"""Token rules every stage shares: which token starts a sequence, and the one sampler.

`bos_id` is the BOS rule of calibration text, teacher samples, uptraining documents and
perplexity; `sample_tokens` draws the calibration text of `convert` (when no
--calibration-data is given) and uptrain's teacher samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _first(value: Any) -> int | None:
    """A token id, or the first of a list of them (configs may list several EOS ids)."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


def bos_id(tokenizer: Any = None, config: Mapping[str, Any] | Any = None, *, eos_fallback: bool = False) -> int | None:
    """The token a sequence starts with: the tokenizer's BOS, else the config's (a config.json
    dict or a loaded config); with `eos_fallback`, else the EOS, which models without a BOS
    (GPT-2) use as the document separator. None when there is none."""
    def get(obj: Any, key: str) -> Any:
        if obj is None:
            return None
        return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)

    keys = ("bos_token_id", "eos_token_id") if eos_fallback else ("bos_token_id",)
    for key in keys:
        for source in (tokenizer, config):
            tid = _first(get(source, key))
            if tid is not None:
                return tid
    return None


# Part of uptrain's teacher-sample cache key: samples drawn by an older sampler are not mixed with new ones.
SAMPLER_VERSION = "static-cache-v2"


def _new_cache(model: Any, max_len: int) -> Any:
    """A preallocated KV cache when the model supports one (no per-step concatenation), else a
    dynamic one. A model whose class cannot apply its position bias over a preallocated cache
    (`ArchSpec.takes_static_cache`) gets a dynamic one."""
    from transformers import DynamicCache, StaticCache

    from gqakit.core.loaded import find_loaded

    spec = find_loaded(model)
    if spec is not None and not spec.takes_static_cache(model.config.to_dict()):
        return DynamicCache()
    if getattr(model, "_supports_static_cache", True) and getattr(model, "_can_compile_fullgraph", True):
        try:
            return StaticCache(config=model.config, max_cache_len=max_len)
        except Exception:  # an architecture without a static-cache layout
            pass
    return DynamicCache()


def sample_tokens(model: Any, prompt: Sequence[int], num: int, length: int, *, temperature: float = 1.0,
                  top_k: int | None = None, never: Sequence[int] = (), generator: Any = None) -> Any:
    """[num, length] tokens sampled after `prompt`: one batched forward per new token, KV cached.

    The whole batch shares the prompt, so there is no padding and no attention mask: the
    first forward reads the prompt, each later one a single new token per sequence. Sampling
    is ancestral from softmax(logits / temperature), optionally cut to the top_k logits
    (top_k=None: the full distribution); tokens in `never` (e.g. EOS, for sequences of a
    fixed length) are never drawn. Measured on one CPU thread with stories260K, batch
    1,024, 256 new tokens: 12.5k tokens/s, against 7.0k for the same loop on a dynamic cache
    (which grows by concatenation) and ~8k for `generate`.
    """
    import torch

    from gqakit.core.loading import cache_kwarg

    dev = next(model.parameters()).device
    was_training = model.training
    cache_kw = cache_kwarg(model)
    model.eval()
    p = len(prompt)
    cache = _new_cache(model, p + length)
    x = torch.tensor([list(prompt)] * num, device=dev, dtype=torch.long)
    out = torch.empty(num, length, dtype=torch.long, device=dev)
    pos = torch.arange(p, device=dev)
    with torch.inference_mode():
        for i in range(length):
            logits = model(input_ids=x, **{cache_kw: cache}, use_cache=True, cache_position=pos).logits[:, -1].float()
            logits = logits / temperature
            if never:
                logits[:, list(never)] = float("-inf")
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            x = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            out[:, i] = x[:, 0]
            pos = pos[-1:] + 1
    model.train(was_training)
    return out
