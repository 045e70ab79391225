"""`EngineBench`: the decode grid on any engine of `gqakit.engines` (vLLM, llama.cpp, ...).

It follows the `Bench` protocol (`point.Bench`) on top of an `Engine`, so speed points, the
roofline prediction (the bytes a step must read, from the model's geometry in the compute
dtype, or in the engine's own storage where it states them: `step_bytes`), `summarize`, the report and the plots are the same for every engine. The engine
times a whole point itself (`Engine.time_point`: prefill per repetition, seconds per decode
step); each point records the engine and the KV cache the engine allocated
(`Engine.kv_allocation`). An engine's steps cannot alternate one by one with another
model's (`begin_rep` / `timed_step` refuse), so models on an external engine are timed in
runs of their own.
"""

from __future__ import annotations

from typing import Any

from gqakit.core.errors import GqakitError
from gqakit.core.loaded import loaded_shape
from gqakit.eval.records import SpeedPoint
from gqakit.eval.speed.bench import step_weights
from gqakit.eval.speed.point import OpenPoint, PointCost, step_cost, summarize, timings


class EngineBench:
    """Times grid points of one model on a loaded `engine`; `model` (the same weights as
    transformers loads them, on any device) gives the geometry the predictions need."""

    def __init__(self, engine: Any, model: Any, *, device: Any, dtype: Any) -> None:
        import torch

        self.engine_obj = engine
        self.engine = str(engine.name)
        self.device, self.dtype = torch.device(device), dtype
        self.elem = torch.finfo(dtype).bits // 8
        shape = loaded_shape(model.config)
        self.heads, self.kv_heads, self.head_dim, self.layers = (shape.num_heads, shape.num_kv_heads,
                                                                 shape.head_dim, shape.num_layers)
        self.weight_bytes, self.matmul_params = step_weights(model, self.elem)
        self.kv_bytes_per_token = shape.kv_bytes_per_token(self.elem)
        self.kv_window_shares = shape.window_shares()  # sliding layers read min(window, depth)
        self.allocation = engine.kv_allocation()
        # an engine that stores the model in other types than the compute dtype (llama.cpp: a
        # quantised GGUF, an F16 cache) states the bytes a step reads in its own storage
        own = getattr(engine, "step_bytes", None)
        if callable(own):
            self.weight_bytes, self.kv_bytes_per_token = own()
        self.graph_error: str | None = None
        self.warmups: dict[int, int] = {}   # open point (id) -> warm-up runs its first repetitions take

    def probe(self) -> dict[str, Any]:
        return {"implementation": f"the {self.engine} engine's own",
                "decode_path": f"{self.engine} engine (gqakit.engines), its own kernels and KV cache"}

    # -- one grid point -------------------------------------------------------------------
    def open_point(self, batch: int, prompt_len: int, new_tokens: int, warmup: int, *,
                   prefill_once: bool = False, **axes: Any) -> OpenPoint:
        if prefill_once:
            raise GqakitError(f"--prefill-once is for the gqakit and transformers engines, not {self.engine}")
        pt = OpenPoint(batch, prompt_len, new_tokens)
        pt.kv_bytes = self.allocation.total_bytes
        self.warmups[id(pt)] = warmup
        return pt

    def run_reps(self, pt: OpenPoint, reps: int) -> None:
        warmup = self.warmups.pop(id(pt), 0)  # the engine runs them untimed before its first repetition
        t = self.engine_obj.time_point(pt.batch, pt.prompt_len, pt.new_tokens, reps, warmup)
        if len(t.prefill_s) != reps or not t.decode_s:
            raise GqakitError(f"the {self.engine} engine returned {len(t.prefill_s)} prefill timings for {reps} "
                              f"repetitions and {len(t.decode_s)} decode samples")
        pt.pre += list(t.prefill_s)
        pt.dec += list(t.decode_s)
        pt.reps += reps

    def rep(self, pt: OpenPoint) -> None:
        self.run_reps(pt, 1)

    def begin_rep(self, pt: OpenPoint) -> None:
        raise GqakitError(f"the {self.engine} engine times whole grid points; its decode steps cannot alternate "
                          "with another model's (time each model in its own run)")

    def timed_step(self, pt: OpenPoint) -> float:
        self.begin_rep(pt)
        return 0.0

    def close_point(self, pt: OpenPoint, roof: dict[str, float]) -> SpeedPoint:
        if pt.result is None:
            # warmup_s stays 0: the engine runs its warm-up inside time_point and does not time it apart
            self.warmups.pop(id(pt), None)
            pt.result = summarize(self, pt, roof, peak=None)
        return pt.result

    def run_point(self, batch: int, prompt_len: int, new_tokens: int, reps: int, warmup: int,
                  roof: dict[str, float], *, prefill_once: bool = False) -> SpeedPoint:
        pt = self.open_point(batch, prompt_len, new_tokens, warmup, prefill_once=prefill_once)
        self.run_reps(pt, reps)
        return self.close_point(pt, roof)

    # -- what the point's record says ----------------------------------------------------
    def point_cost(self, pt: OpenPoint) -> PointCost:
        return step_cost(self, pt)

    def point_path(self, pt: OpenPoint, graph_used: bool) -> tuple[str, dict[str, Any]]:
        mode = f"{self.engine} engine"
        return mode, {"steps": mode, "weights": f"as the {self.engine} engine loads them",
                      "prefill": "every repetition"}

    def prefill_fields(self, pt: OpenPoint) -> dict[str, Any]:
        return {"prefill_samples": len(pt.pre), **timings(pt.batch, pt.pre, pt.dec)}
