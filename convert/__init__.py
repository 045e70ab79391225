"""gqakit.convert: MHA -> GQA conversion of Hugging Face model folders and GGUF files.

The package is callable: `gqakit.convert(src, out, num_kv_heads=G, ...)` runs `gqakit convert`
(see `convert` below, or `help(gqakit.convert.__call__)`):

    import gqakit
    gqakit.convert("./llama-mha", "./llama-g4", num_kv_heads=4, method="align")
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gqakit.convert.refit_options import RefitOptions
from gqakit.convert.settings import ConvertSettings
from gqakit.core import apicall

# The options of `gqakit convert` that are not conversion settings (ConvertSettings), with
# their defaults: where it runs, the GGUF output type, the output rule, and how it reports.
RUN_OPTIONS: dict[str, tuple[Any, Any]] = {
    "device": (str, "auto"),
    "gguf_type": (str | None, None),
    "overwrite": (bool, False),
    "dry_run": (bool, False),
    "quiet": (bool, False),
    "trust_remote_code": (bool, False),
}


def convert(src: str | Path, out: str | Path, **settings: Any) -> Path | list[str]:
    """Convert the model SRC to grouped-query attention, written to OUT: `gqakit convert`.

    SRC is a model folder (or a .gguf file); OUT a model folder (or, from a .gguf SRC, a
    .gguf file). The keyword arguments are `gqakit convert`'s options by their Python names
    (`num_kv_heads` is `-g/--num-kv-heads`), with the same defaults and checks: every one is
    checked before anything is written, and a problem raises `gqakit.core.errors.GqakitError`
    with the same one line the command prints. `refit` takes the align-refit options as a dict
    (`--refit-option KEY=VALUE`). Returns OUT, resolved; with `dry_run=True`, the plan as lines
    of text, and nothing is written.

    Example:

        import gqakit
        out = gqakit.convert("./llama-mha", "./llama-g2", num_kv_heads=2, method="mean", quiet=True)
    """
    args = apicall.bind(SIGNATURE, (src, out), settings)
    from gqakit.convert.cli import run_convert
    from gqakit.core.trust import consent

    run = {k: args.pop(k) for k in RUN_OPTIONS}
    with consent(run.pop("trust_remote_code")):
        return run_convert(args.pop("src"), args.pop("out"), refit=args.pop("refit"),
                           shard_size_given="max_shard_size" in settings, **run, **args)


def _signature() -> inspect.Signature:
    """src, out, then ConvertSettings' fields (but `source` and `source_hub`, the Hub id it resolves to) and RUN_OPTIONS, keyword-only."""
    positional = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str | Path)
                  for n in ("src", "out")]
    fields = apicall.field_parameters(ConvertSettings.model_fields, skip=("source", "source_hub"),
                                      annotations={"refit": RefitOptions | Mapping[str, Any] | None})
    run = [inspect.Parameter(n, apicall.KEYWORD, annotation=a, default=d) for n, (a, d) in RUN_OPTIONS.items()]
    return inspect.Signature([*positional, *fields, *run], return_annotation=Path | list[str])


SIGNATURE = _signature()
convert.__signature__ = SIGNATURE  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    """`convert_checkpoint` and `convert_gguf` (`pipeline`), imported on first use: torch is slow
    to import."""
    if name in ("convert_checkpoint", "convert_gguf"):
        from gqakit.convert import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


apicall.callable_module(__name__, convert)

__all__ = ["convert", "convert_checkpoint", "convert_gguf"]
