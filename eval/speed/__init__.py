"""Decode speed: prefill (time to first token) and per-token decode over a batch x prompt grid.

- `settings`: `SpeedSettings`, validated once where they enter.
- `roofline`: the device's roofs (copy bandwidth, matmul FLOP/s) and the speedup they
  predict for one step over another (`predict_speedup`).
- `steps`: the decode steps of one model on a static cache (`DecodeSteps`: `new_cache`,
  `prefill`, `decode_step`, `capture_graph`, `rewind`).
- `point`: the `Bench` protocol every timed model follows (decoder-only and encoder-decoder),
  `OpenPoint`, a point's state while open, and `summarize`, the one record of a closed point.
- `bench`: `DecodeBench` times grid points of one decoder-only model; the max-batch search
  (`search_max_batch`).
- `grid`: the grid runners, one model or several with their steps alternating.
- `seq2seq`: `Seq2SeqBench`, the same for an encoder-decoder over batch x input length x
  output length (the encoder once per point, both caches read by every step).

The decode step's fast parts (attention, packed weights, fused layers, the C++ kernels)
are in `gqakit.runtime`.
"""

from gqakit.eval.speed.bench import DecodeBench, huge_page_bytes, search_max_batch
from gqakit.eval.speed.grid import evaluate_speed, evaluate_speed_together, run_points_alternating, speed_result
from gqakit.eval.speed.point import Bench, OpenPoint, PointCost, summarize
from gqakit.eval.speed.seq2seq import Seq2SeqBench, evaluate_speed_seq2seq
from gqakit.eval.speed.roofline import (Prediction, StepCost, copy_bandwidth, matmul_flops, measure_roof, median_roof,
                                        percentile, predict_speedup, share)
from gqakit.eval.speed.settings import SpeedSettings, parse_ints
from gqakit.eval.speed.steps import CapturedStep, DecodeSteps

__all__ = ["Bench", "PointCost", "summarize", "CapturedStep", "DecodeBench", "DecodeSteps", "OpenPoint", "Prediction", "Seq2SeqBench", "SpeedSettings", "StepCost",
           "copy_bandwidth", "evaluate_speed", "evaluate_speed_together", "huge_page_bytes", "matmul_flops",
           "measure_roof", "median_roof", "parse_ints", "percentile", "predict_speedup", "run_points_alternating",
           "search_max_batch", "share", "speed_result", "evaluate_speed_seq2seq"]
