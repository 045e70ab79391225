"""One `gqakit eval` run as a function: load, measure, assemble the results dict.

Kept apart from the click layer so the demo and tests call it directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gqakit.core.device import resolve_device  # noqa: F401  (re-exported)
from gqakit.core.errors import GqakitError
from gqakit.eval.results import SCHEMA, model_info, run_info, write_results

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def resolve_dtype(dtype: str | None, device: str) -> Any:
    """float32 on CPU (half is slow there), bfloat16 on GPU, unless told otherwise."""
    import torch

    if dtype in (None, "auto"):
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise GqakitError(f"--dtype must be one of {', '.join(sorted(set(DTYPES)))}; got {dtype!r}")
    return getattr(torch, DTYPES[dtype])


def run_eval(model_path: str | Path, *, data: str | None = None, ppl: bool = True, speed: bool = False,
             context: int = 512, stride: int | None = None, max_chars: int | None = None,
             text_field: str = "text", speed_settings: Any = None, device: str | None = None,
             dtype: str | None = None, out: Path | None = None, command: list[str] | None = None,
             progress: bool = True) -> dict[str, Any]:
    """Measure perplexity and/or decode speed of one model; write `out` if given."""
    import torch

    from gqakit.core.loading import load_causal_lm, load_tokenizer, split_source

    if not ppl and not speed:
        raise GqakitError("nothing to measure: pass --ppl, --speed or both")
    if ppl and not data:
        raise GqakitError("--ppl needs --data FILE (or hf:NAME[:CONFIG][:SPLIT])")
    split_source(model_path)  # a clear error for a missing path before anything slow
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    doc = None
    if ppl:
        from gqakit.eval.perplexity import read_text

        doc = read_text(data, max_chars=max_chars, text_field=text_field)  # fail on bad data before loading
    model = load_causal_lm(model_path, dtype=dt, device=dev)
    info = model_info(model, model_path, torch.finfo(dt).bits // 8)
    results: dict[str, Any] = {"schema": SCHEMA, "run": run_info(command=command, device=dev, dtype=dt),
                               "model": info}
    if ppl:
        from gqakit.eval.perplexity import evaluate_perplexity

        tok = load_tokenizer(model_path)
        results["perplexity"] = evaluate_perplexity(model, tok, doc, context=context, stride=stride, device=dev,
                                                    max_positions=info["max_positions"], progress=progress).to_dict()
    if speed:
        from gqakit.eval.speed import SpeedSettings, evaluate_speed

        results["speed"] = evaluate_speed(model, speed_settings or SpeedSettings(), device=dev, dtype=dt,
                                          max_positions=info["max_positions"], progress=progress)
    if out is not None:
        write_results(results, Path(out))
    return results
