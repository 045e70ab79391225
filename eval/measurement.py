"""The measurement seam of `gqakit eval`: a registry of what it can measure, as
lm-evaluation-harness has one of tasks.

A `Measurement` is everything gqakit knows about one metric:

- `name`: its block's key in the results file (and in `compare`'s rows);
- `flags`: a pydantic model of its command-line options. Each field with a `flag(...)`
  default becomes a `gqakit eval` option (and so a `gqakit.evaluate` keyword): its
  declarations, type, default and help come from the field;
- `settings`: turns the flags into the measurement's settings (None: not asked for), every
  check done there, before anything loads;
- `record`: its block, a `records.Record`, validated as a results file is read;
- `run`: measures the loaded model (a `Context`) and returns the block;
- optionally `check` (cheap checks before anything is read), `prepare` (reading and
  tokenizing before the model loads; what it returns goes to `run`), `inputs` (files OUT must
  never be), `summary` (the lines `gqakit eval` prints of its block), `done` (said once every
  measurement has run) and `report` (its section of `gqakit compare`'s report: a `ReportSection`).

`register` adds one; `MEASUREMENTS` holds them in the order they run and their flags appear,
and `results.BLOCKS` their blocks, which a results file holds by name. The built-in ones
(perplexity, decode speed, lm-evaluation-harness tasks) are registered the same way by
`gqakit.eval.measures` (imported with `gqakit.eval`), whose `measurements()` is the registry
with them in it; a new metric is one module that calls `register`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from gqakit.core.errors import GqakitError
from gqakit.eval.records import ModelInfo, Record
from gqakit.eval.results import BLOCKS, EvalResult

IO_HEADING = "Input and output"  # the --help heading of the options that name inputs and outputs


def flag(*decls: str, default: Any = None, help: str, lead: bool = False, group: str | None = None,
         **cli: Any) -> Any:
    """A flags-model field that is a `gqakit eval` option: `decls` (e.g. "--context"), its
    default and help, and click's keywords (`type`, `is_flag`, `show_default`, `metavar`).
    `lead`: the option that asks for the measurement, declared before the others (so the
    recorded command names what was measured first); `group`: a `--help` heading other than
    the measurement's own."""
    return Field(default, description=help,
                 json_schema_extra={"cli": {"decls": decls, "lead": lead, "group": group, **cli}})


class Flags(BaseModel):
    """Base of a measurement's flags model. Values are kept as given (the command line has
    parsed them; the settings model checks them), and `model_fields_set` says which were given."""

    model_config = {"arbitrary_types_allowed": True}

    @classmethod
    def given(cls, values: dict[str, Any]) -> "Flags":
        """The flags from the options that were given; the others keep their defaults."""
        return cls.model_construct(**{k: v for k, v in values.items() if k in cls.model_fields})


@dataclass
class Context:
    """What a measurement's `run` gets: the loaded model and how it was loaded."""

    model: Any
    model_path: str | Path
    device: str
    dtype: Any
    info: ModelInfo
    encoder_decoder: bool
    progress: bool = True
    quiet: bool = False


@dataclass
class ReportSection:
    """A measurement's part of `gqakit compare`'s report, built from the typed blocks.

    `row(result, baseline)`: what goes into that model's row under the measurement's name
    (None: nothing); `markdown(rows, names)`: the report.md lines of the section, from the
    rows' entries as `row` made them (None where a model has none)."""

    row: Callable[[Any, Any], Any]
    markdown: Callable[[list[Any], list[str]], list[str]] | None = None
    warnings: Callable[[list[EvalResult], list[str]], list[str]] | None = None


@dataclass
class Measurement:
    """One registered metric (see the module docstring)."""

    name: str
    heading: str                              # its `gqakit eval --help` heading
    asked_by: str                             # how the command asks for it, for "nothing to measure"
    flags: type[Flags]
    settings: Callable[[Any], Any]            # flags -> settings, or None when not asked for
    record: type[Record]
    run: Callable[[Context, Any, Any], Record]  # (context, settings, prepared) -> block
    check: Callable[[Any, str | Path, bool], None] | None = None      # (settings, model, encoder_decoder)
    prepare: Callable[[Any, str | Path, bool, bool], Any] | None = None  # (settings, model, enc-dec, quiet)
    inputs: Callable[[Any], list[tuple[str, Any]]] | None = None
    summary: Callable[[Any], list[str]] | None = None  # block -> the lines `gqakit eval` prints
    done: Callable[[Any, Any, bool], None] | None = None  # (block, prepared, quiet): said once all have run
    report: ReportSection | None = None
    builtin: bool = field(default=False, repr=False)  # gqakit's own: never unregistered; report columns of its own


MEASUREMENTS: dict[str, Measurement] = {}


def register(m: Measurement) -> Measurement:
    """Add a measurement (its name must be new); its block is then read and written with
    results files, its flags are `gqakit eval`'s (for commands built after this call)."""
    if m.name in MEASUREMENTS:
        raise GqakitError(f"a measurement named {m.name!r} is already registered")
    if m.name in {"schema", *EvalResult.model_fields}:
        raise GqakitError(f"{m.name!r} is a key of the results file itself; name the measurement otherwise")
    MEASUREMENTS[m.name] = m
    BLOCKS[m.name] = m.record
    return m


def unregister(name: str) -> None:
    """Remove a measurement that is not built in (tests)."""
    m = MEASUREMENTS.get(name)
    if m is None or m.builtin:
        raise GqakitError(f"no registered measurement {name!r} that can be removed")
    del MEASUREMENTS[name]
    BLOCKS.pop(name, None)


def flag_fields(m: Measurement) -> list[tuple[str, Any]]:
    """The fields of `m.flags` that are options, in declaration order."""
    return [(n, f) for n, f in m.flags.model_fields.items()
            if isinstance(f.json_schema_extra, dict) and "cli" in f.json_schema_extra]


__all__ = ["Context", "Flags", "IO_HEADING", "MEASUREMENTS", "Measurement", "ReportSection", "flag", "flag_fields",
           "register", "unregister"]
