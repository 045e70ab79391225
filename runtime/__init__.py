"""gqakit's own decode runtime: the fast decode step behind the `gqakit` engine
(`gqakit.engines`), timed by the speed benchmark (`gqakit.eval.speed`).

- `attention`: `gqakit_sdpa`, the attention function registered with transformers that
  never copies K/V up to all query heads; each model carries its decode kernel choice.
- `grouped`: the grouped decode attention (query heads as rows of their K/V head).
- `packed`: weights packed once for the few rows of a decode step.
- `kernels`: gqakit's C++ CPU kernels (`cpu_kernels.cpp`), built on first use.
- `families`, `layers`: the fused CPU decode step, one compiled call per decoder layer.

Nothing here imports `gqakit.eval` or `gqakit.engines`: it imports only `gqakit.core`.
"""
