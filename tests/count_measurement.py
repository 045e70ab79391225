"""A toy measurement, as a new metric is written: one module, registered with `register()`.

`--count-text FILE` counts the tokens the model's tokenizer makes of FILE; the results file
gets a `count` block, `gqakit compare` a column of its own in report.json and a section in
report.md. Nothing else of gqakit knows about it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, StrictInt, StrictStr

from gqakit.core.errors import GqakitError
from gqakit.eval.measurement import Context, Flags, Measurement, ReportSection, flag, register, unregister
from gqakit.eval.records import Record


class CountFlags(Flags):
    count_text: Any = flag("--count-text", lead=True, help="Count the tokens of this text file.")
    count_limit: Any = flag("--count-limit", type=int, help="Count only the first N characters.")


class CountSettings(BaseModel):
    path: Path
    limit: int | None = None


class CountResult(Record):
    path: StrictStr
    chars: StrictInt
    tokens: StrictInt


def settings(f: CountFlags) -> CountSettings | None:
    if f.count_text is None:
        if f.count_limit is not None:
            raise GqakitError("--count-limit goes with --count-text FILE")
        return None
    return CountSettings(path=f.count_text, limit=f.count_limit)


def check(s: CountSettings, model: Any, encoder_decoder: bool) -> None:
    if not s.path.is_file():
        raise GqakitError(f"--count-text: no such file: {s.path}")


def run(ctx: Context, s: CountSettings, prepared: Any) -> CountResult:
    from gqakit.core.loading import load_tokenizer

    text = s.path.read_text()[:s.limit]
    return CountResult(path=str(s.path), chars=len(text), tokens=len(load_tokenizer(ctx.model_path)(text)["input_ids"]))


def row(block: CountResult, base: CountResult | None) -> dict[str, Any]:
    return {"tokens": block.tokens, "delta": None if not base else block.tokens - base.tokens}


def markdown(entries: list[Any], names: list[str]) -> list[str]:
    return ["", "## Token count", ""] + [f"- {n}: {e['tokens']} tokens" for n, e in zip(names, entries) if e]


COUNT = Measurement(name="count", heading="Token count", asked_by="--count-text", flags=CountFlags,
                    settings=settings, record=CountResult, run=run, check=check,
                    inputs=lambda s: [("count text", s.path)],
                    summary=lambda b: [f"count: {b.tokens} tokens in {b.chars} characters"],
                    report=ReportSection(row=row, markdown=markdown))


def install() -> None:
    register(COUNT)


def uninstall() -> None:
    unregister(COUNT.name)
