"""The decode benchmark over a batch x prompt grid: one model (`evaluate_speed`, what
`gqakit eval --speed` runs) or several with their steps alternating (`evaluate_speed_together`,
what `gqakit demo` runs)."""

from __future__ import annotations

import os
from typing import Any

from tqdm.auto import tqdm

from gqakit.core.errors import GqakitError
from gqakit.eval.records import MaxBatch, SpeedPoint, SpeedResult
from gqakit.eval.speed.bench import DecodeBench
from gqakit.eval.speed.point import Bench
from gqakit.eval.speed.roofline import copy_bandwidth, matmul_flops, measure_roof, median_roof, roof as make_roof
from gqakit.eval.speed.settings import SpeedSettings


def evaluate_speed(model: Any, settings: SpeedSettings, *, device: Any, dtype: Any,
                   max_positions: int | None = None, progress: bool = True,
                   model_path: Any = None) -> SpeedResult:
    """The whole decode benchmark: roofs, attention path, grid, and max batch per prompt length.

    An encoder-decoder runs its own grid, batch x input length x output length (`seq2seq`).
    `settings.engine` says what runs the steps: gqakit's runtime (`DecodeBench`'s fast path),
    stock transformers (its plain path), or an external engine loaded from `model_path`
    (`EngineBench`)."""
    import torch

    if settings.engine not in ("gqakit", "transformers"):
        return evaluate_speed_engine(model, model_path, settings, device=device, dtype=dtype,
                                     max_positions=max_positions, progress=progress)

    if getattr(model.config, "is_encoder_decoder", False):
        from gqakit.eval.speed.seq2seq import evaluate_speed_seq2seq

        return evaluate_speed_seq2seq(model, settings, device=device, dtype=dtype, progress=progress)
    settings.check_model(False)
    settings.check_positions(max_positions)
    if settings.compile and torch.device(device).type != "cuda":
        tqdm.write("gqakit: note: --compile on the CPU needs a C++ compiler and compiles each model once per grid "
                   "point (about a minute each on 2 cores); the compile time is reported apart")
    # The fast path unless --eager: CUDA graphs on a GPU (checked token for token against the
    # eager step, eager again if capture fails), weights packed once on the CPU, and the
    # grouped matmul decode attention. --eager is the plain transformers step (SDPA).
    fast = not settings.plain
    if progress and fast and not settings.compile and torch.device(device).type == "cpu" and dtype == torch.float32:
        from gqakit.runtime import kernels as cpu_kernels

        if not cpu_kernels.is_built() and not os.environ.get("GQAKIT_NO_CPU_KERNELS"):
            tqdm.write("gqakit: compiling the CPU decode kernels once for this machine (about 30 s; cached)")
    bench = DecodeBench(model, device=device, dtype=dtype, compile=settings.compile,
                        cuda_graphs=fast and not settings.compile and torch.device(device).type == "cuda",
                        pack_weights=fast, decode_kernel="matmul" if fast else "sdpa",
                        stock_attention=settings.engine == "transformers")
    bench.engine = settings.engine
    roof = measure_roof(device, dtype)
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
    return speed_result(bench, settings, attention, roof, grid, max_batch)


def evaluate_speed_engine(model: Any, model_path: Any, settings: SpeedSettings, *, device: Any, dtype: Any,
                          max_positions: int | None = None, progress: bool = True) -> SpeedResult:
    """The decode grid on an external engine (`settings.engine`), loaded from `model_path`;
    `model` (loaded by transformers) gives the geometry the roofline prediction needs."""
    from gqakit.core.loading import split_source
    from gqakit.engines import EngineOptions, get_engine
    from gqakit.engines.check import kv_budget_for
    from gqakit.eval.speed.engine_bench import EngineBench

    if model_path is None:
        raise GqakitError(f"the {settings.engine} engine loads the model itself: give the model's path")
    settings.check_model(False)
    settings.check_positions(max_positions)
    folder, gguf = split_source(model_path)
    engine = get_engine(settings.engine)
    # a GGUF computes in its own tensor types (llama.cpp refuses any other dtype)
    options = EngineOptions(dtype="auto" if gguf else str(dtype).removeprefix("torch."),
                            max_len=max(settings.prompt_lens) + settings.new_tokens,
                            max_batch=max(settings.batches), gguf_file=gguf,
                            # a folder: room for the largest point (vLLM's default is most of the memory);
                            # llama.cpp sizes its cache by the context
                            kv_budget_bytes=None if gguf else kv_budget_for(
                                model.config, max(settings.batches) + 1, max(settings.prompt_lens) + settings.new_tokens))
    engine.load(folder, options)
    try:
        bench = EngineBench(engine, model, device=device, dtype=dtype)
        roof = measure_roof(device, dtype)
        grid = [bench.run_point(b, p, settings.new_tokens, settings.reps, settings.warmup, roof)
                for b, p in tqdm([(b, p) for p in settings.prompt_lens for b in settings.batches],
                                 desc=f"decode grid ({settings.engine})", unit="point", disable=not progress)]
    finally:
        engine.close()
    return speed_result(bench, settings, bench.probe(), roof, grid, [],
                        engine_kv=bench.allocation.record())


def speed_result(bench: Any, settings: SpeedSettings, attention: dict[str, Any], roof: dict[str, float],
                 grid: list[SpeedPoint], max_batch: list[MaxBatch], **extra_settings: Any) -> SpeedResult:
    """The `speed` block of a results file for one model's grid."""
    import torch

    return SpeedResult(
        settings={"batches": list(settings.batches), "prompt_lens": list(settings.prompt_lens),
                  "new_tokens": settings.new_tokens, "reps": settings.reps, "warmup": settings.warmup,
                  "compile": settings.compile, "eager": settings.eager, "prefill_once": settings.prefill_once,
                  "torch_threads": torch.get_num_threads(), "prompts": "random token ids",
                  "engine": settings.engine, **extra_settings},
        graph_error=bench.graph_error,
        attention=attention,
        device_roof={"copy_bandwidth_gbs": roof["copy_bandwidth"] / 1e9, "matmul_tflops": roof["matmul_flops"] / 1e12,
                     "ridge_flops_per_byte": roof["ridge_flops_per_byte"]},
        weight_bytes_per_step=bench.weight_bytes,
        kv_bytes_per_token=bench.kv_bytes_per_token,
        grid=grid,
        max_batch=max_batch,
    )


def run_points_alternating(benches: dict[str, Bench], batch: int, prompt_len: int, new_tokens: int, reps: int,
                           warmup: int, *, prefill_once: bool = True,
                           **point: Any) -> tuple[dict[str, SpeedPoint], dict[str, float]]:
    """One grid point of several models in one run: their decode steps alternate one by one
    (A B C, C B A, ...), so that the machine's drift (on a VM, memory speed that changes within
    minutes) hits every model alike and their ratios are measured, not inferred from separate
    runs. The roofs are measured after each repetition; their medians are the point's roof.
    Returns ({name: point}, roof). The benches are `Bench`es: `DecodeBench`es, or
    `seq2seq.Seq2SeqBench`es with the output length in `point` (`output_len=`; `prompt_len` is
    then the input length)."""
    points = {n: b.open_point(batch, prompt_len, new_tokens, warmup, prefill_once=prefill_once, **point)
              for n, b in benches.items()}
    live = [n for n in benches if points[n].result is None]
    first = next(iter(benches.values()))
    roofs = []
    try:
        for r in range(reps):
            order = live if r % 2 == 0 else live[::-1]
            for n in order:
                benches[n].begin_rep(points[n])
            for i in range(new_tokens):
                for n in (order if i % 2 == 0 else order[::-1]):
                    benches[n].timed_step(points[n])
            roofs.append(make_roof(copy_bandwidth(first.device), matmul_flops(first.device, first.dtype)))
    except BaseException:
        for n in live:
            points[n].stack.close()
        raise
    roof = median_roof(roofs)
    return {n: benches[n].close_point(points[n], roof) for n in benches}, roof


def evaluate_speed_together(models: dict[str, Any], settings: SpeedSettings, *, device: Any, dtype: Any,
                            max_positions: int | None = None, progress: bool = True) -> dict[str, SpeedResult]:
    """`evaluate_speed` for several loaded models at once, their steps alternating at every grid
    point (`run_points_alternating`): what `gqakit demo` uses, so that its report's speedups
    are ratios measured in one run. The fast path only (no --compile, --eager or max batch)."""
    import torch

    settings.check_positions(max_positions)
    if any(getattr(m.config, "is_encoder_decoder", False) for m in models.values()):
        raise GqakitError("timing models together supports decoder-only models; time an encoder-decoder on its own")
    if settings.compile or settings.eager or settings.max_batch_search:
        raise GqakitError("timing models together supports the default fast path only")
    cuda = torch.device(device).type == "cuda"
    benches = {n: DecodeBench(m, device=device, dtype=dtype, cuda_graphs=cuda, pack_weights=True,
                              decode_kernel="matmul") for n, m in models.items()}
    for b in benches.values():
        b.engine = "gqakit"
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
    roof = median_roof(roofs)
    return {n: speed_result(benches[n], settings, attention[n], roof, grids[n], [],
                            timed_with=list(models), timing="one run, the models' decode steps alternating one by one")
            for n in benches}
