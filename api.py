"""The Python API's functions that are not packages: `gqakit.evaluate` and `gqakit.convert_model`
(`gqakit.convert` and `gqakit.uptrain` are the callable packages; docs/api.md).

`evaluate` runs `gqakit eval`: its keyword arguments are the command's options, its signature
generated from the command's own option list, and it builds its settings with the command's
code (`eval.cli.eval_settings`, `eval.runner.run_eval`). `convert_model` converts a model in
memory with the conversion's own plan and head math. Nothing here imports torch until called.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from gqakit.core import apicall
from gqakit.core.errors import GqakitError
from gqakit.core.text import EvalText, TextSource

# `gqakit eval` options whose Python name differs from click's (a builtin's name there)
RENAMED = {"compile_": "compile"}
RENAMED_BACK = {v: k for k, v in RENAMED.items()}
TEXT_SPEC = "<text>"  # where a text given as a string is recorded as coming from


@dataclass(frozen=True)
class StringText(TextSource):
    """A text given as a string (`evaluate(text=...)`), read as a text file with these contents
    is read (universal newlines; the sha256 of its UTF-8 bytes); it is no file, so no output
    check lists it as an input."""

    text: str = ""

    @property
    def is_dataset(self) -> bool:
        return False

    @property
    def file(self) -> Path | None:
        return None

    def check_exists(self, what: str = "data file") -> None:
        pass

    def read(self, *, max_chars: int | None = None, text_field: str = "text") -> EvalText:
        raw = self.text.encode("utf-8")
        text = self.text.replace("\r\n", "\n").replace("\r", "\n")
        text = text if max_chars is None else text[:max_chars]
        if not text.strip():
            raise GqakitError("text is empty")
        digest = hashlib.sha256(raw if max_chars is None else text.encode("utf-8")).hexdigest()
        return EvalText(text=text, source=self.spec, sha256=digest, max_chars=max_chars)


def evaluate(model: str | Path, **options: Any) -> Any:
    """Measure a model as `gqakit eval MODEL` does: perplexity, decode speed, task accuracy.

    MODEL is a model folder or a .gguf file. The text is a file (`data=`, or
    `hf:NAME[:CONFIG][:SPLIT]`), or a string (`text=`). The other keyword arguments are the
    command's options by their Python names (`context=`, `stride=`, `speed=True`,
    `tasks="arc_easy"`, `device=`, ...) with the same defaults and checks. Returns the typed
    `gqakit.eval.results.EvalResult` (`.perplexity.token_perplexity`, `.speed`, `.tasks`);
    with `out=`, also writes it as the command's results JSON (`gqakit compare` reads it).
    A problem raises `gqakit.core.errors.GqakitError` with the command's one line.

    Example:

        import gqakit
        result = gqakit.evaluate("./llama-g2", data="valid.txt", context=256)
        print(result.perplexity.token_perplexity)
    """
    args = apicall.bind(evaluate_signature(), (model,), options)
    from gqakit.core.trust import consent
    from gqakit.eval.cli import eval_settings
    from gqakit.eval.runner import run_eval

    model, text, data = args.pop("model"), args.pop("text"), args.pop("data")
    if text is not None and data is not None:
        raise GqakitError("give the text as data= (a file) or as text= (a string), not both")
    if text is not None:
        if not isinstance(text, str):
            raise GqakitError(f"text= takes a string, got {type(text).__name__}")
        if args["objective"] == "paired":
            raise GqakitError("objective paired reads a JSONL file of input/target objects: give it as data=")
        data = StringText(TEXT_SPEC, text)
    for py, name in RENAMED.items():
        args[py] = args.pop(name)
    run = {k: args.pop(k) for k in ("out", "device", "dtype", "overwrite", "quiet", "trust_remote_code")}
    given = {RENAMED_BACK.get(k, k) for k in options} | {"data"}  # others keep the command's defaults
    with consent(run["trust_remote_code"]):
        measures = eval_settings({"data": data, **args}, given)
        out = None if run["out"] is None else Path(run["out"])
        return run_eval(str(model), measures=measures, device=run["device"], dtype=run["dtype"], out=out,
                        command=None, progress=not run["quiet"], overwrite=run["overwrite"], quiet=run["quiet"])


@cache
def evaluate_signature() -> inspect.Signature:
    """model, text, then `gqakit eval`'s options (its click parameters), keyword-only: the
    signature follows the command, so the two cannot differ."""
    import click

    from gqakit.eval.cli import eval_cmd

    p = inspect.Parameter
    params = [p("model", p.POSITIONAL_OR_KEYWORD, annotation=str | Path),
              p("text", apicall.KEYWORD, default=None, annotation=str | None)]
    ctx = click.Context(eval_cmd)
    for param in eval_cmd.params:
        if param.name == "model":
            continue
        default = None if param.required else param.get_default(ctx, call=True)
        if default is getattr(click.core, "UNSET", None):  # click 8.2+: an option without a default
            default = None
        params.append(p(RENAMED.get(param.name, param.name), apicall.KEYWORD, default=default,
                        annotation=_annotation(param, default)))
    return inspect.Signature(params, return_annotation="gqakit.eval.results.EvalResult")


def _annotation(param: Any, default: Any) -> Any:
    """The Python type of a click parameter."""
    import click

    kind: Any
    if getattr(param, "is_flag", False):
        kind = bool
    elif isinstance(param.type, click.Choice):
        kind = Literal[tuple(param.type.choices)]
    elif isinstance(param.type, click.Path):
        kind = str | Path
    else:
        kind = {click.INT: int, click.FLOAT: float, click.BOOL: bool}.get(param.type, str)
    return kind | None if default is None else kind


evaluate.__signature__ = evaluate_signature()  # type: ignore[attr-defined]


def convert_model(model: Any, num_kv_heads: int, method: str = "mean", *, grouping: str = "auto",
                  seed: int = 0, force: bool = False) -> Any:
    """A transformers model in memory, converted to `num_kv_heads` K/V heads; nothing is written.

    The conversion is `gqakit convert`'s, on the model's weights: the same plan, grouping and
    method (mean, first, random, align, align-scale), and the config's KV-head count set. Returns
    a new model of the same class, dtype and device (the original is left as it is). Decoder-only
    families whose transformers class has grouped-query attention only: for gpt2, gpt_neox, opt
    and the encoder-decoders, save the model and use `gqakit.convert`, which writes gqakit's
    modeling file beside the weights; align-refit calibrates on text, also `gqakit.convert`'s job.
    `num_kv_heads` equal to the model's own is refused unless `force=True` (a copy), as on the
    command line.

    Example:

        import gqakit
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("./llama-mha")
        model_g2 = gqakit.convert_model(model, num_kv_heads=2, method="align")
    """
    from gqakit.convert.memory import convert_in_memory

    return convert_in_memory(model, num_kv_heads, method, grouping=grouping, seed=seed, force=force)
