"""gqakit.uptrain: continue pre-training a converted GQA model on 🤗 accelerate.

The package is callable: `gqakit.uptrain(config, overrides, ...)` runs `gqakit uptrain` (see
`uptrain` below, or `help(gqakit.uptrain.__call__)`):

    import gqakit
    model_dir = gqakit.uptrain("stories260K-g2", {"model.path": "s260k-g2", "teacher.path": "stories260K"})
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gqakit.core import apicall
from gqakit.uptrain.config import UptrainConfig

# The options of `gqakit uptrain` besides the config and its overrides, with their defaults.
RUN_OPTIONS: dict[str, tuple[Any, Any]] = {
    "overwrite": (bool, False),
    "resume": (bool, False),
    "dry_run": (bool, False),
    "quiet": (bool, False),
    "trust_remote_code": (bool, False),
}


def uptrain(config: str | Path | Mapping[str, Any], overrides: Mapping[str, Any] | None = None,
            **options: Any) -> Path | UptrainConfig:
    """Continue pre-training a converted model: `gqakit uptrain CONFIG [section.key=value ...]`.

    `config` is what the command takes (a YAML file), or the config itself as a dict.
    `overrides` are the command's `section.key=value` pairs as a dict of dotted keys
    (`{"model.path": "./llama-g2", "train.tokens": 500_000}`); a section's overrides can also
    be given by its name (`train={"tokens": 500_000, "lr": 3e-4}`); values are Python values.
    The run is the command's: every input is checked before anything is written, and a problem
    raises `gqakit.core.errors.GqakitError` with the command's one line. Returns the final model
    folder (`output.dir/model`); with `dry_run=True`, the config as the run would use it, after
    every check that loads no model, and nothing is written.

    Example:

        import gqakit
        model_dir = gqakit.uptrain("run.yaml", {"model.path": "./llama-g2"}, train={"tokens": 4096})
    """
    args = apicall.bind(SIGNATURE, (config, overrides), options)
    from gqakit.core.trust import consent
    from gqakit.uptrain.preflight import preflight

    items = [override_item(k, v) for k, v in dict(args["overrides"] or {}).items()]
    for section in UptrainConfig.model_fields:
        items += [override_item(f"{section}.{k}", v) for k, v in dict(args[section] or {}).items()]
    with consent(args["trust_remote_code"]):
        checked = preflight(args["config"], items, overwrite=args["overwrite"], resume=args["resume"])
        if args["dry_run"]:
            return checked.cfg
        from gqakit.uptrain.trainer import run_checked

        return run_checked(checked, quiet=args["quiet"])


def override_item(key: str, value: Any) -> str:
    """`key=value` as the command line gives it (values are read as YAML): a string that YAML
    reads back unchanged as it is, anything else (and any other string) as JSON, which YAML
    reads as the same value."""
    import yaml

    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        try:
            if yaml.safe_load(value) == value and "\n" not in value:
                return f"{key}={value}"
        except yaml.YAMLError:
            pass
    return f"{key}={json.dumps(value)}"


def _signature() -> inspect.Signature:
    """config, overrides, one keyword per config section (UptrainConfig's fields), RUN_OPTIONS."""
    p = inspect.Parameter
    head = [p("config", p.POSITIONAL_OR_KEYWORD, annotation=str | Path | Mapping[str, Any]),
            p("overrides", p.POSITIONAL_OR_KEYWORD, default=None, annotation=Mapping[str, Any] | None)]
    sections = [p(name, apicall.KEYWORD, default=None, annotation=Mapping[str, Any] | None)
                for name in UptrainConfig.model_fields]
    run = [p(n, apicall.KEYWORD, annotation=a, default=d) for n, (a, d) in RUN_OPTIONS.items()]
    return inspect.Signature([*head, *sections, *run], return_annotation=Path | UptrainConfig)


SIGNATURE = _signature()
uptrain.__signature__ = SIGNATURE  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    """`run_uptrain` (`trainer`), imported on first use: torch is slow to import."""
    if name == "run_uptrain":
        from gqakit.uptrain import trainer

        return trainer.run_uptrain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


apicall.callable_module(__name__, uptrain)

__all__ = ["run_uptrain", "uptrain"]
