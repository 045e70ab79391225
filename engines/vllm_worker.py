"""The vLLM side of gqakit's vLLM engine: one `vllm.LLM` behind a JSON-lines pipe.

This file runs inside vLLM's own virtual environment (vLLM pins an older transformers than
gqakit), started by `gqakit.engines.vllm` as `<vllm python> <this file>`. It imports only
the standard library and vLLM, and nothing of gqakit.

Protocol: one JSON object per line on stdin, one reply per line on the original stdout
(vLLM's own logging is sent to stderr, so it never mixes with the replies). Every request
has an "op"; every reply has "ok" and, when ok is false, "error" (one line). Ops:

- load {model, dtype, max_len, kv_budget_bytes, max_batch, trust_remote_code}
- generate {prompts: [[ids]], max_new_tokens} -> {tokens, logprobs, seconds}
- time {batch, prompt_len, new_tokens, reps, warmup} -> {prefill_s, decode_s}
- kv {} -> vLLM's KV-cache configuration: blocks, block size, bytes per block per layer
- close {}

The worker exits on "close" or when stdin closes (gqakit exited).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# This file sits beside gqakit's client module `vllm.py`: drop its folder from the import
# path, so that `import vllm` finds vLLM.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# The engine core runs in this process, so its KV-cache configuration can be read directly.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _first_line(e: BaseException) -> str:
    """One line for a failure: its first line, and the second when the first is only a
    heading (pydantic's "1 validation error for ModelConfig")."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = " ".join(lines[:2] if len(lines) > 1 and len(lines[0]) < 60 else lines[:1])
    return f"{type(e).__name__}: {text}"[:600] if text else type(e).__name__


class Worker:
    def __init__(self) -> None:
        self.llm: Any = None
        self.vocab = 0

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=req["model"], dtype=req.get("dtype") or "auto", max_model_len=int(req["max_len"]),
            max_num_seqs=int(req.get("max_batch") or 32), trust_remote_code=bool(req.get("trust_remote_code")),
            enforce_eager=True, enable_prefix_caching=False, seed=0, disable_log_stats=True)
        if req.get("kv_budget_bytes"):
            kwargs["kv_cache_memory_bytes"] = int(req["kv_budget_bytes"])
        self.llm = LLM(**kwargs)
        self.vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        return {"vocab": self.vocab, "vllm": __import__("vllm").__version__}

    def _run(self, prompts: list[list[int]], max_new_tokens: int, logprobs: bool) -> tuple[list[Any], float]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=int(max_new_tokens), ignore_eos=True,
                                logprobs=0 if logprobs else None, detokenize=False)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return outs, time.perf_counter() - start

    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        outs, seconds = self._run(req["prompts"], req["max_new_tokens"], True)
        tokens, logprobs = [], []
        for out in outs:
            c = out.outputs[0]
            tokens.append([int(t) for t in c.token_ids])
            logprobs.append([float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs or [])])
        return {"tokens": tokens, "logprobs": logprobs, "seconds": seconds}

    def time(self, req: dict[str, Any]) -> dict[str, Any]:
        batch, plen, new = int(req["batch"]), int(req["prompt_len"]), int(req["new_tokens"])
        prefill, decode = [], []
        for rep in range(int(req["warmup"]) + int(req["reps"])):
            # distinct prompts per sequence and repetition (prefix caching is off anyway)
            prompts = [[(7919 * b + 31 * i + 101 * rep) % (self.vocab - 3) + 3 for i in range(plen)]
                       for b in range(batch)]
            _, t1 = self._run(prompts, 1, False)
            _, tn = self._run(prompts, new, False)
            if rep >= int(req["warmup"]):
                prefill.append(t1)
                decode.append((tn - t1) / (new - 1))
        return {"prefill_s": prefill, "decode_s": decode}

    def kv(self, req: dict[str, Any]) -> dict[str, Any]:
        engine = self.llm.llm_engine
        cache = engine.vllm_config.cache_config
        core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
        config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
        if config is None:
            raise RuntimeError("vLLM's engine core runs in another process; its KV-cache configuration "
                               "cannot be read (VLLM_ENABLE_V1_MULTIPROCESSING must be 0)")
        groups = []
        for g in config.kv_cache_groups:
            spec = g.kv_cache_spec
            groups.append({"spec": type(spec).__name__, "layers": len(g.layer_names),
                           "block_size": int(spec.block_size), "page_size_bytes": int(spec.page_size_bytes),
                           "num_kv_heads": getattr(spec, "num_kv_heads", None),
                           "head_size": getattr(spec, "head_size", None),
                           "dtype": str(getattr(spec, "dtype", "")).replace("torch.", "")})
        # each layer's own spec: a group's spec is its first layer's, and the layers of one
        # group may hold different KV heads (a per-layer model: vLLM puts every full-attention
        # layer in one group and gives each its own page size)
        layers = []
        executor = getattr(core, "model_executor", None)
        specs = executor.get_kv_cache_specs()[0] if executor is not None else {}
        for name, spec in specs.items():
            layers.append({"name": name, "page_size_bytes": int(spec.page_size_bytes),
                           "block_size": int(spec.block_size), "num_kv_heads": getattr(spec, "num_kv_heads", None),
                           "head_size": getattr(spec, "head_size", None)})
        return {"num_blocks": int(config.num_blocks), "groups": groups, "layers": layers,
                "tensor_bytes": sum(int(t.size) for t in config.kv_cache_tensors),
                "cache_dtype": str(cache.cache_dtype), "num_gpu_blocks": cache.num_gpu_blocks}


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by vLLM goes to stderr
    sys.stdout = sys.stderr
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "close":
                replies.write(json.dumps({"ok": True}) + "\n")
                return 0
            if op not in ("load", "generate", "time", "kv"):
                raise ValueError(f"unknown op {op!r}")
            if op != "load" and worker.llm is None:
                raise RuntimeError("no model is loaded")
            reply = {"ok": True, **getattr(worker, op)(req)}
        except Exception as e:  # every failure goes back as one line; the client raises it
            reply = {"ok": False, "error": _first_line(e)}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
