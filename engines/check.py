"""The serving check: does an engine serve this model as transformers computes it, and does it
allocate the KV cache gqakit predicts?

Engine-agnostic. `engine.generate` runs N prompts greedily for T tokens; transformers (the
same folder or GGUF, loaded by the caller) then scores prompt + the engine's tokens
teacher-forced. A position agrees when the engine's token is transformers' argmax. A
mismatch is explained by a near-tie when transformers' log-prob of its own argmax minus its
log-prob of the engine's token is below the margin of the engine's dtype or quantisation
(`MARGINS`). The engine's allocated KV bytes per token must equal gqakit's prediction,
2 x sum over layers of (KV heads x head_dim) x cache-dtype bytes (`predicted_kv_bytes`); both
sides are a cache of the engine's capacity divided by that capacity. An engine that sizes each
layer's cache itself (it reports `positions_per_layer`: transformers' static cache) holds the
capacity in a full-attention layer and min(window, capacity) in a sliding one
(`held_positions`), so the prediction counts those; one that pages every layer per token (vLLM)
is predicted per token, every layer.

PASS: agreement >= `MIN_AGREEMENT`, every mismatch a near-tie, and the KV bytes per token
equal to the prediction (vLLM: exactly per token; block rounding applies to capacity only).
On quantised GGUF weights in llama.cpp agreement is reported, not required (`QUANTISED_RULE`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from gqakit.core.errors import GqakitError
from gqakit.core.units import dtype_named

MIN_AGREEMENT = 0.99

# The largest log-prob gap (nats) between transformers' argmax and the engine's token that
# arithmetic alone can explain, by what the engine computes in. An engine's kernels sum in
# another order than transformers', so their logits differ by rounding; a token whose
# log-prob is within that rounding of the argmax's is a near-tie either may win.
MARGINS: dict[str, float] = {
    # 24-bit mantissa: a reordered sum through a few dozen layers moves logits by ~1e-4
    # relative (~1e-3 nats on logits of ~10); 0.01 leaves a tenfold guard and nothing more
    "float32": 0.01,
    # 11-bit mantissa (~5e-4 per rounding): logits move by ~0.01-0.05 nats through the stack.
    # Also llama.cpp on F32/F16/BF16 GGUF weights: activations stay float, its F16 KV cache rounds
    "float16": 0.1,
    # 8-bit mantissa (~4e-3 per rounding): an order of magnitude above float16
    "bfloat16": 0.5,
    # llama.cpp on quantised GGUF weights (Q4/Q5/Q8/K-quants). The teacher dequantises the same
    # weights, so the weights differ in nothing; llama.cpp rounds each quantised matmul's input
    # activations to 8 bits per 32-value block (Q8_0/Q8_1: a step of the block's largest value
    # / 127), a rounding as coarse as bfloat16's 8-bit mantissa on every matmul input, so the
    # margin is bfloat16's. Agreement is reported but not required (`QUANTISED_RULE`).
    "quantised": 0.5,
}

# GGUF tensor types whose matmuls keep float activations in llama.cpp.
FLOAT_GGUF_TYPES = {"f32": "float16", "float32": "float16", "f16": "float16", "float16": "float16",
                    "bf16": "float16", "bfloat16": "float16"}


def margin_for(dtype: str, quant: str | None = None) -> tuple[str, float]:
    """(the row of `MARGINS` that applies, its margin) for an engine computing in `dtype` on
    weights quantised as `quant` (a GGUF's coarsest matmul weight type, `gguf_quant`, or None
    for float weights)."""
    if quant:
        row = FLOAT_GGUF_TYPES.get(quant.lower(), "quantised")
        return row, MARGINS[row]
    d = dtype_named(dtype)
    name = d.name if d is not None and d.name in MARGINS else "float32"
    return name, MARGINS[name]


def gguf_quant(types: Iterable[str]) -> str | None:
    """The type that sets a GGUF's margin, from its matmul weights' type names (one per tensor,
    e.g. from `GGUFReader(...).tensors`): the most common quantised type where any matmul weight
    is quantised, since llama.cpp then rounds that matmul's activations to 8 bits; else the most
    common float type; None for none."""
    names = [str(t).upper() for t in types]
    quantised = [t for t in names if t.lower() not in FLOAT_GGUF_TYPES] or names
    return max(set(quantised), key=quantised.count) if quantised else None


# ---- the rules

RULE = (f"agreement >= {MIN_AGREEMENT:.0%}, every mismatch a near-tie, and the engine's KV bytes per token "
        "equal to gqakit's prediction")
# Quantised GGUFs in llama.cpp: 8-bit activation rounding flips near-ties by the dozen where the
# model's choices are flat (SmolLM2-135M Q4_1 on English text: ~8% of positions), so agreement
# cannot reach 99%; every flip must still be a near-tie within the quantised margin.
QUANTISED_RULE = ("quantised weights (8-bit activations in llama.cpp): every mismatch a near-tie within the "
                  "quantised margin (agreement reported, not required), and the engine's KV bytes per token "
                  "equal to gqakit's prediction")


def rule_for(margin_row: str) -> tuple[str, float]:
    """(the rule's text, the agreement it requires) for a row of `MARGINS`."""
    return (QUANTISED_RULE, 0.0) if margin_row == "quantised" else (RULE, MIN_AGREEMENT)


# ---- the KV prediction

CACHE_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}   # llama.cpp's names of its cache types


def cache_bytes(name: str) -> int | None:
    """Bytes per element of a KV-cache dtype named by torch, gqakit or llama.cpp; None for a
    quantised cache (bytes per element not a whole number)."""
    d = dtype_named(str(name))
    return d.bytes if d is not None else CACHE_DTYPE_BYTES.get(str(name).lower())


def predicted_kv_bytes(kv_heads: int | Sequence[int], head_dim: int, elem_bytes: int, layers: int | None = None,
                       v_padded: bool = False) -> int:
    """KV-cache bytes per token: 2 (K and V) x sum over layers of KV heads x head_dim x bytes.
    `kv_heads`: one count per layer, or one count for every one of `layers` layers.
    `v_padded`: V of every layer as wide as the widest layer's (llama.cpp without flash
    attention, when the layers' KV heads differ); K stays per layer."""
    heads = [int(kv_heads)] * int(layers or 0) if isinstance(kv_heads, int) else [int(h) for h in kv_heads]
    if not heads:
        raise GqakitError("predicted_kv_bytes needs the KV heads of every layer (or `layers`)")
    v_heads = max(heads) * len(heads) if v_padded else sum(heads)
    return (sum(heads) + v_heads) * int(head_dim) * int(elem_bytes)


def held_positions(windows: Sequence[int | None] | None, capacity: int, layers: int) -> list[int]:
    """The positions each layer's cache holds at `capacity`: all of them in a full-attention
    layer, min(window, capacity) in a sliding one (as transformers' StaticCache sizes it)."""
    windows = list(windows or [None] * layers)
    return [int(capacity) if w is None else min(int(w), int(capacity)) for w in windows]


def predicted_cache_bytes(kv_heads: Sequence[int], head_dim: int, elem_bytes: int, positions: Sequence[int]) -> int:
    """KV-cache bytes of a cache whose layer l holds `positions[l]` positions of `kv_heads[l]`
    heads: 2 (K and V) x sum over layers of heads x positions x head_dim x bytes."""
    return 2 * sum(int(h) * int(p) for h, p in zip(kv_heads, positions, strict=True)) * int(head_dim) * int(elem_bytes)


def layer_windows(hf_config: Any) -> list[int | None] | None:
    """Each decoder layer's sliding window (None: full attention), as transformers reads the
    config and the architecture table states the family's rule; None when no layer slides."""
    from gqakit.core.loaded import loaded_shape

    windows = loaded_shape(hf_config).layer_windows
    return None if windows is None else list(windows)


def layer_kv_heads(hf_config: Any) -> list[int]:
    """The KV heads of each decoder layer: a per-layer list where the config has one (the
    geometry's `kv_heads_per_layer`, or a list-valued `num_key_value_heads`), else the one count."""
    from gqakit.core.loaded import loaded_shape

    cfg = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
    listed = getattr(cfg, "num_key_value_heads", None)
    if isinstance(listed, (list, tuple)):
        return [int(h) for h in listed]
    shape = loaded_shape(hf_config)
    per_layer = getattr(shape, "kv_heads_per_layer", None)
    if per_layer:
        return [int(h) for h in per_layer]
    return [shape.num_kv_heads] * shape.num_layers


def kv_budget_for(hf_config: Any, sequences: int, seq_len: int) -> int:
    """KV bytes for `sequences` of `seq_len` tokens at float32, each rounded up to whole
    256-token blocks: room for any engine's block size, nothing like a server's share. What
    gqakit asks of vLLM for a check or a speed grid, whose default (most of the machine's
    memory) a busy CPU machine cannot give."""
    cfg = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    per_seq = -(-int(seq_len) // 256) * 256
    return predicted_kv_bytes(layer_kv_heads(hf_config), head_dim, 4) * per_seq * int(sequences)


# ---- the result

class Mismatch(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: int                  # which prompt
    position: int                # which generated token (0: the first)
    engine_token: int
    transformers_token: int      # transformers' argmax there
    margin: float                # transformers' log-prob of its argmax minus of the engine's token (nats)
    near_tie: bool               # margin below the dtype's


class KvCheck(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    allocated_bytes_per_token: int
    predicted_bytes_per_token: int | None  # None: the engine's cache dtype has no whole bytes per element
    cache_dtype: str
    kv_heads_per_layer: list[int]
    head_dim: int
    capacity_tokens: int
    total_bytes: int
    detail: dict[str, Any]
    match: bool
    # the sliding window of each layer (None: full attention) where some layers slide
    layer_windows: list[int | None] | None = None
    # whether the prediction holds min(window, capacity) positions in a sliding layer (an engine
    # that sizes each layer's cache) or every position (an engine that pages every layer per token)
    windows_held: bool = False
    predicted_total_bytes: int | None = None  # the predicted cache at the capacity


class ServingCheck(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: str
    model: str
    prompts: int
    new_tokens: int
    prompt_source: str           # "text" (a fixed English passage, tokenized) or "random ids (seed 0)"
    positions: int
    agreement: float             # fraction of positions where the engine's token is transformers' argmax
    margin_row: str              # which row of MARGINS applied
    margin: float
    mismatches: list[Mismatch]
    unexplained: int             # mismatches that are not near-ties
    max_abs_logprob_diff: float | None   # largest |engine log-prob - transformers'| of the engine's tokens
    kv: KvCheck
    rule: str
    passed: bool


# The text the prompts are cut from where the model has a tokenizer (fixed, so checks repeat).
TEXT = ("The little town sat at the edge of a wide river. Every morning the baker opened his shop before the sun "
        "came up, and the smell of bread filled the street. Children walked to school along the water, and old "
        "men sat on the bridge to watch the boats go by. One day a stranger arrived with a heavy bag and a map. "
        "He asked the baker where the road to the mountains began, and the baker told him to follow the river "
        "north until the trees grew thick. The stranger thanked him, bought a loaf of bread, and set off before "
        "noon. Nobody in the town saw him again, but that winter a letter came for the baker with a drawing of "
        "the highest peak and a few words of thanks.")


def make_prompts(n: int, length: int, vocab: int, tokenizer: Any = None) -> tuple[list[list[int]], str]:
    """N prompts of `length` token ids: windows of `TEXT` through the tokenizer when it makes
    enough tokens, else seeded random ids (what a model without a tokenizer gets)."""
    if tokenizer is not None:
        ids = [int(t) for t in tokenizer(TEXT, add_special_tokens=False)["input_ids"] if 0 <= int(t) < vocab]
        if len(ids) >= length + n - 1:
            step = max(1, (len(ids) - length) // max(1, n - 1)) if n > 1 else 0
            return [ids[i * step:i * step + length] for i in range(n)], "text"
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)], "random ids (seed 0)"


def judge(engine_tokens: list[list[int]], logprobs: list[Any], margin: float) -> tuple[int, list[Mismatch]]:
    """(positions, mismatches) of the engine's tokens against transformers' log-probs
    (`logprobs[i]`: a [T, vocab] tensor, row t scoring generated token t of prompt i)."""
    positions, out = 0, []
    for i, (toks, lp) in enumerate(zip(engine_tokens, logprobs)):
        best = lp.argmax(-1)
        for t, tok in enumerate(toks):
            positions += 1
            if int(best[t]) != tok:
                gap = float(lp[t, best[t]] - lp[t, tok])
                out.append(Mismatch(prompt=i, position=t, engine_token=int(tok), transformers_token=int(best[t]),
                                    margin=gap, near_tie=gap < margin))
    return positions, out


def teacher_logprobs(model: Any, prompts: list[list[int]], generated: list[list[int]]) -> list[Any]:
    """transformers' log-probs at each generated position, prompt + the engine's tokens teacher-forced."""
    import torch

    out = []
    with torch.inference_mode():
        for p, g in zip(prompts, generated):
            if not g:
                out.append(torch.zeros((0, 1)))
                continue
            ids = torch.tensor([p + g], device=model.device)
            logits = model(input_ids=ids).logits[0, len(p) - 1:len(p) - 1 + len(g)].float()
            out.append(torch.log_softmax(logits, dim=-1).cpu())
    return out


def kv_check(engine: Any, hf_config: Any, dtype: str) -> KvCheck:
    """The engine's allocation against the prediction for the cache dtype it reports (else `dtype`)."""
    alloc = engine.kv_allocation()
    types = set(alloc.detail.get("type_k") or []) | set(alloc.detail.get("type_v") or [])
    cache_dtype = str(alloc.detail.get("cache_dtype") or (types.pop() if len(types) == 1 else dtype))
    if cache_dtype.lower() == "auto":  # vLLM's default: the cache in the model's dtype
        cache_dtype = dtype
    heads = layer_kv_heads(hf_config)
    cfg = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    elem = cache_bytes(cache_dtype)
    capacity = int(alloc.capacity_tokens)
    windows = layer_windows(hf_config)
    # an engine that reports the positions each layer holds sizes each layer's cache itself
    engine_positions = alloc.detail.get("positions_per_layer")
    windows_held = engine_positions is not None
    positions = held_positions(windows if windows_held else None, capacity, len(heads))
    total = None if elem is None else predicted_cache_bytes(heads, head_dim, elem, positions)
    # per token as the engines state it: the cache at the capacity over the capacity
    predicted = None if total is None else (total // capacity if capacity else predicted_kv_bytes(heads, head_dim, elem))
    detail = dict(alloc.detail)
    if elem is not None and detail.get("v_padded_to_widest_layer") and len(set(heads)) > 1:
        # what llama.cpp's buffer holds besides the sequence's own rows (the check's bytes)
        detail["buffer_bytes_per_token_v_padded"] = predicted_kv_bytes(heads, head_dim, elem, v_padded=True)
    # an engine that reports each layer's KV heads (vLLM) must hold the plan's, layer by layer
    engine_heads = alloc.detail.get("kv_heads_per_layer")
    same_heads = not engine_heads or [int(h) for h in engine_heads] == heads
    # and one that sizes each layer's cache must hold the predicted positions, layer by layer, in all
    same_held = not windows_held or ([int(p) for p in engine_positions] == positions
                                     and int(alloc.total_bytes) == total)
    return KvCheck(allocated_bytes_per_token=int(alloc.bytes_per_token), predicted_bytes_per_token=predicted,
                   cache_dtype=cache_dtype, kv_heads_per_layer=heads, head_dim=head_dim,
                   capacity_tokens=capacity, total_bytes=int(alloc.total_bytes),
                   detail=detail, match=predicted is not None and int(alloc.bytes_per_token) == predicted
                   and same_heads and same_held, layer_windows=windows, windows_held=windows_held,
                   predicted_total_bytes=total)


def run_check(model_path: str | Path, engine: Any, teacher: Any, *, dtype: str, prompts: list[list[int]],
              new_tokens: int, prompt_source: str = "given", quant: str | None = None) -> ServingCheck:
    """The serving check of a loaded `engine` against `teacher` (the same weights, loaded by
    transformers) on `prompts`, `new_tokens` greedy tokens each (see the module docstring)."""
    if not prompts or new_tokens < 1:
        raise GqakitError("the serving check needs at least one prompt and one new token")
    gen = engine.generate(prompts, new_tokens)
    if len(gen.tokens) != len(prompts):
        raise GqakitError(f"the {engine.name} engine returned {len(gen.tokens)} generations for {len(prompts)} prompts")
    lps = teacher_logprobs(teacher, prompts, gen.tokens)
    row, margin = margin_for(dtype, quant)
    positions, mismatches = judge(gen.tokens, lps, margin)
    diff = None
    if gen.logprobs is not None:
        gaps = [abs(float(lp[t, tok]) - float(elp)) for toks, lp, elps in zip(gen.tokens, lps, gen.logprobs)
                for t, (tok, elp) in enumerate(zip(toks, elps))]
        diff = max(gaps) if gaps else None
    kv = kv_check(engine, teacher.config, dtype)
    agreement = (positions - len(mismatches)) / positions if positions else 0.0
    unexplained = sum(not m.near_tie for m in mismatches)
    rule, required = rule_for(row)
    passed = positions > 0 and agreement >= required and unexplained == 0 and kv.match
    return ServingCheck(engine=engine.name, model=str(model_path), prompts=len(prompts), new_tokens=new_tokens,
                        prompt_source=prompt_source, positions=positions, agreement=agreement, margin_row=row,
                        margin=margin, mismatches=mismatches, unexplained=unexplained,
                        max_abs_logprob_diff=diff, kv=kv, rule=rule, passed=passed)


def sliding_clause(kv: KvCheck) -> str:
    """The KV line's clause on sliding layers ("" without them): how many slide, their window,
    and how the prediction counts them."""
    slid = [w for w in kv.layer_windows or [] if w is not None]
    if not slid:
        return ""
    held = (f"each holds min(window, capacity) = {min(min(slid), kv.capacity_tokens)}" if len(set(slid)) == 1
            else "each holds min(window, capacity)") if kv.windows_held else "paged per token as full layers"
    wins = "/".join(str(w) for w in sorted(set(slid)))
    return f"; {len(slid)} of {len(kv.layer_windows or [])} layers slide (window {wins}: {held})"


def table(c: ServingCheck) -> list[str]:
    """The short table `gqakit eval --check` prints, ending in PASS or FAIL."""
    ok = lambda b: "ok" if b else "FAIL"  # noqa: E731
    near = sum(m.near_tie for m in c.mismatches)
    lines = [f"serving check: {c.engine} engine vs transformers, {c.prompts} prompts x {c.new_tokens} greedy tokens "
             f"({c.prompt_source})",
             f"  token agreement   {c.positions - len(c.mismatches)}/{c.positions} = {100 * c.agreement:.2f}%  "
             + (f"{ok(c.agreement >= rule_for(c.margin_row)[1])}" if rule_for(c.margin_row)[1] else "(reported)"),
             f"  mismatches        {len(c.mismatches)} ({near} near-ties under {c.margin:g} nats ({c.margin_row}), "
             f"{c.unexplained} unexplained)  {ok(c.unexplained == 0)}"]
    for m in c.mismatches[:5]:
        lines.append(f"    prompt {m.prompt} token {m.position}: engine {m.engine_token}, transformers "
                     f"{m.transformers_token}, gap {m.margin:.4g} nats ({'near-tie' if m.near_tie else 'NOT a near-tie'})")
    if c.max_abs_logprob_diff is not None:
        lines.append(f"  largest |log-prob difference| {c.max_abs_logprob_diff:.3g} nats")
    pred = "n/a (quantised cache)" if c.kv.predicted_bytes_per_token is None else c.kv.predicted_bytes_per_token
    lines.append(f"  KV bytes per token {c.kv.allocated_bytes_per_token} allocated, {pred} predicted "
                 f"({c.kv.cache_dtype}, KV heads {sorted(set(c.kv.kv_heads_per_layer))} x head_dim {c.kv.head_dim}); "
                 f"capacity {c.kv.capacity_tokens} tokens{sliding_clause(c.kv)}  {ok(c.kv.match)}")
    lines.append(("PASS" if c.passed else "FAIL") + f" ({c.rule})")
    return lines


__all__ = ["CheckFailed", "MARGINS", "MIN_AGREEMENT", "QUANTISED_RULE", "RULE", "KvCheck", "Mismatch", "ServingCheck",
           "cache_bytes", "gguf_quant", "held_positions", "judge", "kv_budget_for", "layer_kv_heads", "layer_windows",
           "make_prompts", "margin_for", "predicted_cache_bytes", "predicted_kv_bytes",
           "rule_for", "run_check", "table", "teacher_logprobs"]


class CheckFailed(GqakitError):
    """A serving check that ran and failed: the command exits 1 after writing its results."""

    exit_code = 1
    label = "check failed"
