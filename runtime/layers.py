"""A CPU decode step with one compiled call per decoder layer (Llama-layout, Phi, GPT-NeoX, GPT-2, OPT; fp32).

What is left of an eager decode step once the weights and the KV cache stream at memory
speed (`cpu_kernels.cpp`'s panel GEMM and fused attention) is per-op cost: transformers
runs a layer as ~60 small ops and module calls (RMSNorm as six ops, rotary as seven per
tensor, the cache update, reshapes, the SiLU gate), about 5 ms of SmolLM2-135M's 21-26 ms
step at batch 8 on the CPU profiled in docs/decode.md (`bench/profile_decode.py`). `FusedDecode` runs each
layer as one call of `decode_layer` (norm, one GEMM for q/k/v stacked, rotary, the cache
write, grouped attention, output projection, norm, one GEMM for gate/up stacked, SiLU
gate, down projection, both residual adds), then the final norm and the LM head.

It applies where a model's layers have a layout `decode_layer` computes (`families.py`:
Llama-layout, GPT-NeoX, GPT-2, OPT, Phi), and it is checked before use: one decode step
from the same cache, fused and plain, must give the same logits and write the same cache
slot (`check`); otherwise the plain step runs and `build_fused_decode` says why. Used only
for decode steps without a padding mask (the speed benchmark's); prefill stays
transformers' own.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gqakit.runtime.families import layer_specs, layout_problem
from gqakit.runtime.packed import pack_arena


class FusedDecode:
    """`model`'s decode step as one `decode_layer` call per layer (see the module docstring).

    Called like the model for one decode step: `step(input_ids=[B, 1], cache=..., position_ids=[1, 1])`
    (or `past_key_values=`), returns an object with `.logits` [B, 1, vocab].
    """

    def __init__(self, model: Any, kernels: Any, arena: bool = True) -> None:
        self.model, self.k = model, kernels
        spec = layer_specs(model)
        self.embed, self.rotary, self.final = spec.embed, spec.rotary, spec.final
        self.clip_qkv, self.parallel = spec.clip_qkv, spec.parallel
        head = model.get_output_embeddings()
        # every matrix the step streams, packed into one buffer in the order the step reads them
        # (2 MiB-aligned, advised as huge pages: small matrices too, e.g. a 1-KV-head model's
        # stacked q/k/v, sit on huge pages, and the stream has no gaps)
        mats = [m for e in spec.layers for m in e.mats] + [(*head.weight.shape, head.weight.detach)]
        if arena:
            packed = pack_arena(kernels, [w() for _, _, w in mats])
        else:
            packed = [kernels.pack_weight(w()) for _, _, w in mats]
        self.packed_bytes = sum(t.numel() * 4 for t in packed)
        self.layers = spec.layers
        for i, e in enumerate(self.layers):
            e.wqkv, e.wo, e.wgu, e.wd = packed[4 * i: 4 * i + 4]
            del e.mats
        self.head = packed[-1]
        self.head_bias = None if getattr(head, "bias", None) is None else head.bias.detach()
        self.vocab = head.weight.shape[0]

    def __call__(self, input_ids: Any, cache: Any = None, past_key_values: Any = None, position_ids: Any = None,
                 **_: Any) -> Any:
        import torch

        cache = cache if cache is not None else past_key_values
        b = input_ids.shape[0]
        x = self.embed(input_ids, position_ids)  # [B, 1, hidden]
        if self.rotary is None:  # learned positions (GPT-2): no rotary
            cos = sin = torch.empty(1, 0)
        else:
            cos, sin = self.rotary(x, position_ids)  # [1, 1, D] (or [B, 1, D])
            cos, sin = cos.reshape(-1, cos.shape[-1]).contiguous(), sin.reshape(-1, sin.shape[-1]).contiguous()
        x = x.reshape(b, -1).contiguous()
        first = cache.layers[0]
        slot = int(first.cumulative_length)
        t = first.keys.shape[2]
        mask = torch.zeros(b, t)
        mask[:, slot + 1:] = float("-inf")  # causal: this token and everything before it
        for e, layer in zip(self.layers, cache.layers):
            x = self.k.decode_layer(x, e.ln1, e.eps1, e.wqkv, e.bqkv, e.wo, e.bo, e.ln2, e.eps2, e.wgu, e.wd,
                                    cos, sin, layer.keys, layer.values, slot, mask, e.scale, e.heads, e.inter,
                                    e.qnorm, e.knorm, e.qk_eps, e.norm_kind, self.clip_qkv, e.ln1b, e.ln2b,
                                    e.mlp_kind, e.bup, e.bdown, self.parallel)
            layer.cumulative_length.add_(1)
        x = self.final(x)
        logits = self.k.skinny_linear(x, self.head, self.vocab, self.head_bias)
        return SimpleNamespace(logits=logits.reshape(b, 1, self.vocab))


# How far apart the fused and the plain step may be: the relative error ||got - ref|| / ||ref||
# of the logits and of each layer's new cache entries. Both steps are fp32 with other summation
# orders, and the difference grows through the residual stream: on SmolLM2-135M's 3->1
# conversion (30 layers), over 60 prompts, up to 1.3e-4 for the logits and 8.4e-5 for the
# deepest layers' cache entries (bench/fused_check_errors.py), so an element-wise 1e-4 bound
# would refuse correct steps. A wrong slot, norm, rotary or head map is off by 1e-2 or more.
REL_TOL = 1e-3


def relative_error(got: Any, ref: Any) -> float:
    """||got - ref|| / ||ref|| (0 when both are zero)."""
    den = ref.double().norm().item()
    num = (got.double() - ref.double()).norm().item()
    return num / den if den > 0 else num


def both_steps(model: Any, step: FusedDecode, cache_factory: Any, vocab: int, cache_kw: str = "past_key_values",
               seed: int = 0) -> SimpleNamespace:
    """One decode step of the model and of `step` from two equally prefilled caches (a seeded
    prompt of 2 x 5 tokens): `ref`/`got` logits, `ref_cache`/`got_cache`, and `p`, the slot written."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        b, p = 2, 5
        prompt = torch.randint(0, vocab, (b, p), generator=gen)
        caches = []
        for _ in range(2):
            c = cache_factory(b, p + 2)
            model(input_ids=prompt, **{cache_kw: c}, position_ids=torch.arange(p).unsqueeze(0), use_cache=True)
            caches.append(c)
        tok = torch.randint(0, vocab, (b, 1), generator=gen)
        pos = torch.full((1, 1), p)
        ref = model(input_ids=tok, **{cache_kw: caches[0]}, position_ids=pos, use_cache=True).logits[:, -1]
        got = step(input_ids=tok, past_key_values=caches[1], position_ids=pos).logits[:, -1]
    return SimpleNamespace(ref=ref, got=got, ref_cache=caches[0], got_cache=caches[1], p=p)


def check(model: Any, step: FusedDecode, cache_factory: Any, vocab: int, cache_kw: str = "past_key_values",
          seed: int = 0) -> str | None:
    """One decode step both ways from the same prefilled cache: None if they agree, else why not.

    Deterministic (a seeded prompt), so a model gets the same verdict in every run.
    """
    return verdict(both_steps(model, step, cache_factory, vocab, cache_kw, seed))


def verdict(r: SimpleNamespace, what: str = "fused layers") -> str | None:
    """`check`'s judgement of a `both_steps` result: None if the steps agree, else why not
    (`what` names the step that was checked against the model's own)."""
    import torch

    p = r.p
    err = relative_error(r.got, r.ref)
    if not err <= REL_TOL:
        return f"{what} gave other logits than the model (relative error {err:.2g})"
    for i, (la, lb) in enumerate(zip(r.ref_cache.layers, r.got_cache.layers)):
        err = max(relative_error(lb.keys[:, :, p], la.keys[:, :, p]), relative_error(lb.values[:, :, p], la.values[:, :, p]))
        untouched = torch.equal(la.keys[:, :, p + 1:], lb.keys[:, :, p + 1:]) and torch.equal(
            la.values[:, :, p + 1:], lb.values[:, :, p + 1:])
        if not (err <= REL_TOL and untouched and int(la.cumulative_length) == int(lb.cumulative_length)):
            return f"{what} wrote another cache slot than the model (layer {i + 1}, relative error {err:.2g})"
    return None


def build_fused_decode(model: Any, kernels: Any, cache_factory: Any, vocab: int,
                       cache_kw: str = "past_key_values") -> tuple[FusedDecode | None, str | None]:
    """(A checked `FusedDecode` for `model`, None), or (None, why it does not apply)."""
    why = layout_problem(model) if kernels is not None and hasattr(kernels, "decode_layer") else "no compiled kernels"
    step = None
    if why is None:
        step = FusedDecode(model, kernels)
        why = check(model, step, cache_factory, vocab, cache_kw)
        if why is not None:
            step = None
    return step, why
