"""The results file written by `gqakit eval` and read by `gqakit compare`.

One JSON per evaluated model, split the way peft's method_comparison splits its results:
`run` (how and where the numbers were made), `model` (what was measured), then one block
per measurement (`perplexity`, `speed`, `tasks`: lm-evaluation-harness metrics with their
stderr, task versions and harness version; the block carries its own `format` number). A `schema` key lets `compare` reject any other
JSON early, instead of failing on a missing key halfway through a report.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError
from gqakit.eval.records import EvalResult, ModelInfo, RunInfo

SCHEMA = "gqakit.eval/1"


def git_hash() -> str | None:
    """The commit of the gqakit checkout, when it is one (a wheel install has none)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        if out.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: Any) -> str:
    """A human name for the device: the GPU model, or the CPU model and core count."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def run_info(*, command: list[str] | None, device: Any, dtype: Any) -> RunInfo:
    """Everything needed to trace a number back: command, versions, device, date, commit."""
    import torch
    import transformers

    import gqakit

    return RunInfo(
        command=" ".join(command if command is not None else sys.argv),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        gqakit=gqakit.__version__,
        git=git_hash(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        device=str(device),
        device_name=device_name(device),
        dtype=str(dtype).replace("torch.", ""),
    )


def model_info(model: Any, path: str | Path, dtype_bytes: int) -> ModelInfo:
    """Shape facts of a loaded model, and the KV-cache bytes one token costs."""
    from gqakit.core.arch import loaded_shape

    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    s = loaded_shape(cfg)
    return ModelInfo(
        path=str(path),
        model_type=getattr(cfg, "model_type", None),
        parameters=sum(p.numel() for p in model.parameters()),
        layers=s.num_layers,
        heads=s.num_heads,
        kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_positions=s.max_positions,
        # K and V, every layer, every KV head: what each cached token costs.
        kv_bytes_per_token=s.kv_bytes_per_token(dtype_bytes),
    )


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
        raise GqakitError(f"{p} is not a gqakit results file (not valid JSON: {str(e).splitlines()[0]})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise GqakitError(f"{p} is not a gqakit results file (schema {found!r}, expected {SCHEMA!r}); "
                          "make one with `gqakit eval`")
    if "model" not in data or "run" not in data:
        raise GqakitError(f"{p} is a truncated gqakit results file (no 'model' or 'run' block)")
    return EvalResult.from_json(data, p)  # validated by check_results first


# ----------------------------------------------------------------------------- the fields compare reads
# Validated up front, so a hand-edited or damaged file (a perplexity that is a string, a
# model that is null) is one line naming the file and the key, not a crash mid-report.

def _schema_models() -> Any:
    from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

    Num = StrictFloat  # strict: 5 and 5.0 pass, "5" and null do not

    class _M(BaseModel):
        model_config = ConfigDict(extra="allow")

    class Run(_M):
        command: StrictStr
        date: StrictStr
        gqakit: StrictStr
        git: StrictStr | None = None
        torch: StrictStr
        transformers: StrictStr
        device_name: StrictStr
        dtype: StrictStr

    class Model(_M):
        path: StrictStr
        parameters: StrictInt
        heads: StrictInt
        kv_heads: StrictInt
        kv_bytes_per_token: Num

    class Data(_M):
        path: StrictStr
        sha256: StrictStr

    class Tok(_M):
        name_or_path: StrictStr = ""
        vocab_size: StrictInt | None = None

    class Ppl(_M):
        token_perplexity: Num
        bits_per_byte: Num
        word_perplexity: Num
        context: StrictInt
        stride: StrictInt
        tokens: StrictInt
        data: Data
        tokenizer: Tok

    class Stat(_M):
        median: Num

    class Point(_M):
        batch: StrictInt
        prompt_len: StrictInt
        status: StrictStr
        tokens_per_s: Stat | None = None
        decode_ms_per_token: Stat | None = None
        prefill_ms: Stat | None = None
        roofline_fraction: Num | None = None
        memory_bound: StrictBool | None = None
        kv_cache_bytes: Num | None = None
        peak_memory_bytes: Num | None = None

        @model_validator(mode="after")
        def _ok_has_numbers(self) -> "Point":
            if self.status == "ok":
                for k in ("tokens_per_s", "decode_ms_per_token", "prefill_ms", "roofline_fraction", "memory_bound"):
                    if getattr(self, k) is None:
                        raise ValueError(f"grid point with status ok lacks {k}")
            return self

    class MaxBatch(_M):
        prompt_len: StrictInt
        max_batch: StrictInt
        at_limit: StrictBool
        method: StrictStr = ""

    class Attention(_M):
        decode_path: StrictStr | None = None

    class Speed(_M):
        grid: list[Point] = []
        max_batch: list[MaxBatch] = []
        attention: Attention = Attention()

    class Metric(_M):
        value: Num
        stderr: Num | None = None

    class TaskRow(_M):
        metrics: dict[str, Metric]
        n_shot: StrictInt | None = None

    class Harness(_M):
        version: StrictStr

    class Tasks(_M):  # written by eval/tasks.py (lm-evaluation-harness); its own `format` number
        format: StrictInt
        harness: Harness
        results: dict[str, TaskRow]
        groups: dict[str, TaskRow] = {}

    class Results(_M):
        run: Run
        model: Model
        perplexity: Ppl | None = None
        speed: Speed | None = None
        tasks: Tasks | None = None

    return Results


def check_results(data: dict[str, Any], path: Path) -> None:
    """One GqakitError naming the file and the first bad key, or nothing."""
    from pydantic import ValidationError

    for key in ("perplexity", "speed", "tasks"):
        if key in data and data[key] is None:
            raise GqakitError(f"{path} is not a valid gqakit results file: {key} is null")
    try:
        _schema_models().model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(x) for x in err["loc"])
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        raise GqakitError(f"{path} is not a valid gqakit results file: {key}: {err['msg']} (got {got})") from None
