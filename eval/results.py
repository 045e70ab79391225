"""The results file of `gqakit eval` (schema `gqakit.eval/1`): `EvalResult`, the blocks it
holds by measurement name, and the only way a results file is written or read.

`run` and `model` (eval/records.py) come first; then one block per measurement, of the record
type its registration names (`BLOCKS`, filled by eval/measurement.py `register`; the built-in
perplexity, speed and tasks register as `gqakit.eval` is imported, like any other). A file's
key of a registered name is read as that record; a block of a measurement not registered is
kept as it is, with the other keys this schema does not know. The bytes a file was written
with are the bytes it is written back with (the rules in eval/records.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, StrictStr, ValidationError

from gqakit.core.errors import GqakitError, first_line
from gqakit.eval.records import UNSET, ModelInfo, PerplexityResult, Record, RunInfo, SpeedResult, TasksResult

SCHEMA = "gqakit.eval/1"

# The block of every registered measurement (eval/measurement.py `register`; the built-in ones
# register as `gqakit.eval` is imported): a file's key of that name is read as that record.
BLOCKS: dict[str, type[Record]] = {}


class EvalResult(Record):
    """One results file: one model, measured once. `run` and `model`, then one block per
    measurement, held by its name (`block`, `set_block`, `blocks`), whichever registered it.

    `to_json` writes the blocks in the order the measurements were registered (the built-in
    ones first: perplexity, speed, tasks), then a block of a measurement no longer registered,
    then the keys this schema does not know (`extra`)."""

    schema_: StrictStr = Field(alias="schema")
    run: RunInfo
    model: ModelInfo
    _blocks: dict[str, Record] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any, /) -> None:
        """A registered measurement's block given by keyword (`EvalResult(..., speed=block)`) is
        held as a block, not as an unknown key."""
        extra = self.model_extra or {}
        for name in [k for k in extra if k in BLOCKS]:
            value = extra.pop(name)
            self.set_block(name, value if isinstance(value, Record) else BLOCKS[name].model_validate(value))

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str | Path = "<results>") -> "EvalResult":  # type: ignore[override]
        """The file's blocks, or one GqakitError naming the file and the first bad key."""
        for key in BLOCKS:
            if key in data and data[key] is None:
                raise GqakitError(f"{path} is not a valid gqakit results file: {key} is null")
        try:
            res = cls.model_validate({k: v for k, v in data.items() if k not in BLOCKS})
        except ValidationError as e:
            raise _invalid(path, e, ()) from None
        for key, record in BLOCKS.items():
            if key in data:
                try:
                    res.set_block(key, record.model_validate(data[key]))
                except ValidationError as e:
                    raise _invalid(path, e, (key,)) from None
        return res

    def to_json(self) -> dict[str, Any]:
        head = super().to_json()  # schema, run, model, then the unknown keys
        fields = {(f.alias or n) for n, f in type(self).model_fields.items()}
        out = {k: v for k, v in head.items() if k in fields}
        order = [n for n in BLOCKS if n in self._blocks] + [n for n in self._blocks if n not in BLOCKS]
        out.update({n: self._blocks[n].to_json() for n in order})
        out.update({k: v for k, v in head.items() if k not in fields})
        return out

    def block(self, name: str) -> Any:
        """A measurement's block by its name (a file's block of a measurement not registered: as
        it was read); UNSET when the result has none."""
        return self._blocks[name] if name in self._blocks else self.extra.get(name, UNSET)

    def set_block(self, name: str, block: Record) -> None:
        """Set (or with UNSET, remove) the block of measurement `name`."""
        if block is UNSET:
            self._blocks.pop(name, None)
        else:
            self._blocks[name] = block

    @property
    def blocks(self) -> dict[str, Record]:
        """{measurement name: block}, in the order they were set."""
        return dict(self._blocks)

    # Typed views of the built-in measurements' blocks, for the code that reads their attributes
    # (the report's own columns, `gqakit.evaluate` callers): `block(name)` under another name.
    @property
    def perplexity(self) -> PerplexityResult:
        return self.block("perplexity")  # type: ignore[no-any-return]

    @perplexity.setter
    def perplexity(self, block: PerplexityResult) -> None:
        self.set_block("perplexity", block)

    @property
    def speed(self) -> SpeedResult:
        return self.block("speed")  # type: ignore[no-any-return]

    @speed.setter
    def speed(self, block: SpeedResult) -> None:
        self.set_block("speed", block)

    @property
    def tasks(self) -> TasksResult:
        return self.block("tasks")  # type: ignore[no-any-return]

    @tasks.setter
    def tasks(self, block: TasksResult) -> None:
        self.set_block("tasks", block)


def _invalid(path: str | Path, e: ValidationError, where: tuple[str, ...]) -> GqakitError:
    err = e.errors()[0]
    key = ".".join(str(x) for x in (*where, *err["loc"]))
    got = repr(err.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    return GqakitError(f"{path} is not a valid gqakit results file: {key}: {err['msg']} (got {got})")


def write_results(results: EvalResult, out: Path) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves half a JSON."""
    from gqakit.core.outdir import write_file_atomic

    return write_file_atomic(Path(out), json.dumps(results.to_json(), indent=2, default=str) + "\n")


def read_results(path: str | Path) -> EvalResult:
    """Load a results file, or raise a one-line error saying why it is not one."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise GqakitError(f"results file not found: {p}")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GqakitError(f"{p} is not a gqakit results file (not valid JSON: {first_line(e, None)})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise GqakitError(f"{p} is not a gqakit results file (schema {found!r}, expected {SCHEMA!r}); "
                          "make one with `gqakit eval`")
    if "model" not in data or "run" not in data:
        raise GqakitError(f"{p} is a truncated gqakit results file (no 'model' or 'run' block)")
    return EvalResult.from_json(data, p)


__all__ = ["BLOCKS", "SCHEMA", "EvalResult", "read_results", "write_results"]
