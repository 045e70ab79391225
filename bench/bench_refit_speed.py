"""Where align-refit's time goes, per unit, from the dry run's probe of the first layer
(`convert.calibration.estimate.probe`), timed in process CPU time so that a loaded machine
compares settings fairly, and the whole run's expected CPU seconds at the defaults.

    OMP_NUM_THREADS=1 python -m bench.bench_refit_speed smollm2 --options '{"step_dtype": "bfloat16"}'
    OMP_NUM_THREADS=1 python -m bench.bench_refit_speed stories --options '{"step_dtype": "float32"}'
    OMP_NUM_THREADS=1 python -m bench.bench_refit_speed llama7b-layer  # a 7B-shaped layer, 32 -> 8
    python -m bench.bench_refit_speed --src PATH --g 8 ...          # any folder
    OMP_NUM_THREADS=1 python -m bench.bench_refit_speed smollm2 --sdpa  # transformers' sdpa attention
    OMP_NUM_THREADS=1 python -m bench.bench_refit_speed smollm2 --repeat-kv  # K/V heads repeated in the steps
    OMP_NUM_THREADS=1 python -m bench.bench_refit_speed smollm2 --per-op-adam  # PyTorch's per-op Adam loop

Rows are appended to bench/results/refit_speed.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import RESULTS, SHARED, SMOLLM2, append_jsonl

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WIKITEXT_VALID = str(SHARED / "data/wikitext-2/valid.txt")
MODELS = {"stories": dict(src=SHARED / "models/stories260K", g=2, calib=None),
          "smollm2": dict(src=SMOLLM2, g=1, calib=WIKITEXT_VALID),
          "llama7b-layer": dict(src=None, g=8, calib=WIKITEXT_VALID)}  # src: `llama7b_layer()`
LLAMA7B_LAYER = {"hidden": 4096, "layers": 1, "heads": 32, "intermediate": 11008, "vocab": 49152}


def llama7b_layer() -> Path:
    """A random Llama-2-7B-shaped MHA checkpoint with one decoder layer (bf16, `LLAMA7B_LAYER`) and
    SmolLM2's 49,152-token tokenizer (from its GGUF), built once into gqakit's cache (a new folder,
    renamed into place when complete)."""
    from transformers import AutoTokenizer

    from bench.common import write_random_llama_checkpoint
    from gqakit.core.files import gqakit_cache_dir

    folder = gqakit_cache_dir() / "bench" / "llama7b-layer"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    write_random_llama_checkpoint(tmp, LLAMA7B_LAYER)
    AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name).save_pretrained(tmp)
    os.rename(tmp, folder)  # fails, leaving it alone, where something else has taken the name
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", choices=list(MODELS))
    ap.add_argument("--src", default=None)
    ap.add_argument("--g", type=int, default=None)
    ap.add_argument("--calibration-data", default=None)
    ap.add_argument("--calibration-tokens", type=int, default=65536)
    ap.add_argument("--options", default="{}", help="JSON align-refit options")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sdpa", action="store_true",
                    help="the blocks keep transformers' sdpa attention (calibration.attention not installed)")
    ap.add_argument("--repeat-kv", action="store_true",
                    help="the steps put the pooled K/V heads into the block repeated to its KV head count, as "
                         "for a block that does not take them as they are (steploss.SpanLoss._compact_ok)")
    ap.add_argument("--per-op-adam", action="store_true",
                    help="the steps' Adam as PyTorch's per-op loop (its default on the CPU) instead of its fused "
                         "kernel")
    ap.add_argument("--out", default=str(RESULTS / "refit_speed.jsonl"))
    args = ap.parse_args()
    from gqakit.convert.calibration.estimate import expected_seconds, run_shape
    from gqakit.convert.calibration.probe import probe
    from gqakit.convert.plan import make_plan
    from gqakit.convert.settings import ConvertSettings
    from gqakit.convert.source import open_model

    if args.sdpa:
        from contextlib import contextmanager

        import gqakit.convert.calibration.attention as causal

        causal.installed = contextmanager(lambda config: (yield False))
    if args.repeat_kv:
        from gqakit.convert.calibration.steploss import SpanLoss

        SpanLoss._compact_ok = lambda self, *a: False  # type: ignore[method-assign]
    if args.per_op_adam:
        import torch

        adam_init = torch.optim.Adam.__init__

        def per_op(self: torch.optim.Adam, params: object, *a: object, fused: object = None, **k: object) -> None:
            adam_init(self, params, *a, **k)

        torch.optim.Adam.__init__ = per_op  # type: ignore[method-assign]
    m = dict(MODELS[args.model]) if args.model else dict(src=args.src, g=args.g, calib=args.calibration_data)
    if m["src"] is None:
        m["src"] = llama7b_layer()
    s = ConvertSettings(source=str(m["src"]), num_kv_heads=args.g or m["g"], method="align-refit",
                        calibration_data=args.calibration_data or m["calib"],
                        calibration_tokens=args.calibration_tokens, refit=json.loads(args.options))
    opened = open_model(str(m["src"]), progress=False)
    plan = make_plan(opened, s, device=args.device)
    t0 = time.perf_counter()
    rates = probe(opened, plan, plan.settings, device=args.device, clock=time.process_time)
    shape = run_shape(plan, plan.settings)
    row = {"model": args.model or str(m["src"]), "options": json.loads(args.options),
           "resolved": {k: getattr(plan.settings.options, k) for k in ("steps", "batch", "dtype", "step_dtype",
                                                                         "seq_len", "train", "loss", "lr")},
           "attention": "sdpa" if args.sdpa else "blocked", "kv_in_steps": "repeated" if args.repeat_kv else "auto",
           "adam": "per-op" if args.per_op_adam else "fused",
           "threads": os.environ.get("OMP_NUM_THREADS"), "rates_cpu_s": asdict(rates), "shape": shape,
           "expected_cpu_s": round(expected_seconds(rates, **shape), 1),
           "per_layer_cpu_s": round(rates.per_layer(shape["spans"], shape["steps"], shape["guard_spans"],
                                                            shape["guard_checks"]), 2),
           "probe_wall_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(row))
    append_jsonl(args.out, row)


if __name__ == "__main__":
    main()
