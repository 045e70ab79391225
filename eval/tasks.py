"""`gqakit eval --tasks`: downstream accuracy through lm-evaluation-harness.

The harness (`lm_eval`, the optional extra `gqakit[tasks]`) runs its own tasks on the
model gqakit has already loaded: an `HFLM` wraps that model and its tokenizer, so the
device and dtype rules are `gqakit eval`'s, and `lm_eval.simple_evaluate` does the rest.
gqakit adds what a command line needs around it: every check before the model loads
(harness installed, task names known, `--tasks-path` and its local data files present),
offline datasets (a task whose data are not local fails in one line), and a `tasks`
block in the results file with each metric, its standard error, the task versions and
the harness version.

Local tasks are ordinary harness YAML files in a folder given by `--tasks-path`
(`TaskManager(include_path=...)`); `examples/tasks/` has one over a jsonl file. A task file
with a `!function module.fn` tag makes the harness import `module.py` from beside it: such
a folder is refused before anything runs unless --trust-remote-code was given
(`core.trust.check_task_folder`), and the tasks' Jinja templates render in Jinja's sandbox.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gqakit.core import trust
from gqakit.core.errors import GqakitError, first_line
from gqakit.core.files import file_sha256

if TYPE_CHECKING:
    from gqakit.eval.records import TasksResult

INSTALL = "pip install 'gqakit[tasks]'"
MIN_VERSION = "0.4.13"  # TaskManager.load and Task objects in simple_evaluate, as used here
# Version of the `tasks` block of a results file (the file's own schema stays gqakit.eval/1:
# the block is optional and only adds keys).
TASKS_FORMAT = 1
# The harness's own defaults, recorded with every result.
BOOTSTRAP_ITERS = 100000
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}


class TaskSettings(BaseModel):
    """What `gqakit eval --tasks` runs: the task names and the harness's options. Checked when built."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    tasks: list[str]
    num_fewshot: int | None = None
    limit: int | None = None
    tasks_path: Path | None = None
    batch_size: int = 1
    bootstrap_iters: int = BOOTSTRAP_ITERS
    # filled by check_tasks: the harness's TaskManager (scanning the YAML index takes seconds)
    manager: Any = Field(default=None, repr=False, exclude=True)
    # filled by load_tasks: the built tasks (their datasets read), for simple_evaluate
    loaded: list[Any] | None = Field(default=None, repr=False, exclude=True)
    local_index: bool = Field(default=False, repr=False, exclude=True)  # manager indexes --tasks-path only

    @model_validator(mode="after")
    def _check(self) -> "TaskSettings":
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise GqakitError(f"--num-fewshot must be 0 or more; got {self.num_fewshot}")
        if self.limit is not None and self.limit < 1:
            raise GqakitError(f"--limit must be a positive number of examples per task; got {self.limit}")
        if self.batch_size < 1:
            raise GqakitError(f"--tasks-batch must be at least 1; got {self.batch_size}")
        return self


def parse_tasks(value: str) -> list[str]:
    """`hellaswag,arc_easy` -> ['hellaswag', 'arc_easy']; empty names are an error."""
    names = [t.strip() for t in value.split(",")]
    if not value.strip() or any(not t for t in names):
        raise GqakitError(f"--tasks must be comma-separated task names, e.g. hellaswag,arc_easy; got {value!r}")
    return list(dict.fromkeys(names))


def harness() -> Any:
    """The `lm_eval` module, or one line saying how to install it."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401  (HFLM: needs torch + transformers, which gqakit has)
    except ImportError as e:
        raise GqakitError(f"--tasks needs lm-evaluation-harness, which is not installed ({e.msg if hasattr(e, 'msg') else e}); "
                          f"install it with: {INSTALL}") from None
    from packaging.version import InvalidVersion, Version

    found = harness_version()
    try:
        ok = Version(MIN_VERSION) <= Version(found) < Version("0.5")
    except InvalidVersion:
        ok = True  # a source checkout with an odd version string: let it try
    if not ok:
        raise GqakitError(f"--tasks needs lm-evaluation-harness >={MIN_VERSION},<0.5, found {found}: "
                          f"pip install -U {INSTALL.split(' ', 2)[2]}")
    return lm_eval


def harness_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        import lm_eval

        return str(getattr(lm_eval, "__version__", "unknown"))


@contextmanager
def offline_datasets() -> Iterator[None]:
    """Datasets come from local files or the local datasets cache, never the Hub.

    HF_HUB_OFFLINE=1 is gqakit's default (core/loading.py); a user who sets it to 0 on
    purpose lets the harness fetch a task's data once. HF_DATASETS_OFFLINE follows it."""
    old = os.environ.get("HF_DATASETS_OFFLINE")
    if old is None:
        os.environ["HF_DATASETS_OFFLINE"] = "0" if os.environ.get("HF_HUB_OFFLINE") == "0" else "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)


def is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "1") != "0" or os.environ.get("HF_DATASETS_OFFLINE") == "1"


class _DropPretrainedWarning(logging.Filter):
    """HFLM warns that a model object (not a name) was passed: that is how gqakit uses it."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return "kwarg is not of type `str`" not in msg and "Passed an already-initialized model" not in msg


@contextmanager
def harness_logs(quiet: bool) -> Iterator[None]:
    """The harness's logger: errors only under -q; warnings otherwise (its INFO chatter off)."""
    log = logging.getLogger("lm_eval")
    level = log.level
    flt = _DropPretrainedWarning()
    log.setLevel(logging.ERROR if quiet else logging.WARNING)
    hf_log = logging.getLogger("lm_eval.models.huggingface")
    hf_log.addFilter(flt)
    try:
        yield
    finally:
        log.setLevel(level)
        hf_log.removeFilter(flt)


def check_tasks(settings: TaskSettings, *, quiet: bool = False) -> Any:
    """Every check that needs no model: harness present, options sane, tasks known, local
    task data present. Returns (and keeps in settings.manager) the harness's TaskManager.
    The numbers were checked when the settings were built."""
    if settings.tasks_path is not None:
        p = Path(settings.tasks_path).expanduser()
        if not p.exists():
            raise GqakitError(f"--tasks-path not found: {p}")
        if not p.is_dir():
            raise GqakitError(f"--tasks-path must be a folder of task YAML files; {p} is not a folder")
        if not any(p.rglob("*.yaml")) and not any(p.rglob("*.yml")):
            raise GqakitError(f"--tasks-path {p} holds no .yaml task definitions")
        trust.check_task_folder(p)
    harness()
    include = str(Path(settings.tasks_path).expanduser().resolve()) if settings.tasks_path else None
    tm = None
    with harness_logs(quiet):
        try:
            if include:  # all tasks local: skip indexing the harness's ~15,000 built-in names (seconds)
                tm = _task_manager(include, False, _fingerprint(include))
                if not set(settings.tasks) <= set(tm.all_tasks):
                    tm = None
            settings.local_index = tm is not None
            tm = tm or _task_manager(include, True, _fingerprint(include))
        except Exception as e:  # a broken YAML in --tasks-path: the harness raises yaml/ValueError/...
            raise GqakitError(f"cannot read the task definitions in {settings.tasks_path}: {first_line(e)}") from None
    known = set(tm.all_tasks)
    for name in settings.tasks:
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" or in --tasks-path {settings.tasks_path}" if settings.tasks_path else \
            " (local task YAML files: --tasks-path DIR)"
        broken = _unreadable_yaml(settings.tasks_path) if settings.tasks_path else []
        hint += f"; these task files could not be read: {'; '.join(broken[:3])}" if broken else ""
        raise GqakitError(f"unknown task {name!r}: not a task, group or tag of lm-evaluation-harness "
                          f"{harness_version()}{where}{hint}")
    for name in settings.tasks:
        _check_local_data(tm, name)
    settings.manager = tm
    return tm


def _unreadable_yaml(folder: str | Path) -> list[str]:
    """YAML files under FOLDER that do not parse (the harness's index skips them silently)."""
    import yaml

    class Loader(yaml.SafeLoader):  # the harness's `!function` tags parse as anything
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    bad = []
    for p in sorted(Path(folder).expanduser().rglob("*.y*ml")):
        try:
            yaml.load(p.read_text(), Loader=Loader)  # noqa: S506 (a SafeLoader subclass)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            bad.append(f"{p.name}: {' '.join(str(e).split())[:120]}")
    return bad


def _fingerprint(include: str | None) -> tuple[Any, ...]:
    """What the index of a tasks folder depends on: its files' names, sizes and times."""
    if include is None:
        return ()
    return tuple(sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in Path(include).rglob("*")
                        if p.is_file()))


@functools.lru_cache(maxsize=4)
def _task_manager(include: str | None, defaults: bool, fingerprint: tuple[Any, ...]) -> Any:
    """The harness's index of task names (built once per process: it scans thousands of YAML files)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=defaults)


def load_tasks(settings: TaskSettings, *, quiet: bool = False) -> list[Any]:
    """Build the tasks, which reads their datasets, before any model is loaded: a dataset
    that is not local fails here, in one line. Returns the top-level Task/Group objects
    for simple_evaluate (kept in settings.loaded)."""
    from lm_eval.api.group import Group

    tm = settings.manager or check_tasks(settings, quiet=quiet)
    with harness_logs(quiet), offline_datasets(), sandboxed_templates():
        try:
            loaded = tm.load(list(settings.tasks))
        except Exception as e:
            if not settings.local_index:
                raise _explain(e, settings) from None
            # a local group may name built-in tasks: then the whole index is needed
            full = _task_manager(tm.include_path, True, _fingerprint(tm.include_path))
            try:
                loaded = full.load(list(settings.tasks))
            except Exception as e2:
                raise _explain(e2, settings) from None
            settings.manager, settings.local_index = full, False
    groups = list(loaded["groups"].values())
    in_group = {t.task_name for g in groups for t in g.get_all_tasks()}
    sub = {s.name for g in groups for s in g.get_all_groups()}
    top: list[Any] = [g for g in groups if g.name not in sub and isinstance(g, Group)]
    top += [t for n, t in loaded["tasks"].items() if n not in in_group]
    settings.loaded = top
    return top


def _check_local_data(tm: Any, name: str) -> None:
    """A local task (dataset_path json/csv/...) whose data_files are missing: one line now,
    not a datasets traceback after the model has loaded. Relative paths are read from the
    current directory, as the harness does."""
    entry = tm.task_index.get(name)
    cfg = getattr(entry, "cfg", None)
    if not isinstance(cfg, dict) or cfg.get("dataset_path") not in LOCAL_BUILDERS:
        return
    where = getattr(entry, "yaml_path", None) or "?"
    for f in _data_files(cfg):
        if "://" in f or any(c in f for c in "*?["):
            continue
        if not Path(f).expanduser().is_file():
            raise GqakitError(f"task {name} ({where}) reads data file {f}, which does not exist"
                              + (f" relative to the current directory {Path.cwd()} (lm-evaluation-harness reads "
                                 "relative data_files from there)" if not Path(f).is_absolute() else ""))


def _data_files(cfg: dict[str, Any]) -> list[str]:
    df = (cfg.get("dataset_kwargs") or {}).get("data_files") if isinstance(cfg.get("dataset_kwargs"), dict) else None
    if df is None:
        return []
    if isinstance(df, str):
        return [df]
    if isinstance(df, list):
        return [str(x) for x in df]
    if isinstance(df, dict):
        out = []
        for v in df.values():
            out += [str(x) for x in v] if isinstance(v, list) else [str(v)]
        return out
    return []


def _gqakit_lm(progress: bool) -> type:
    """HFLM with the request bars following gqakit's -q (nothing else changes)."""
    from lm_eval.models.huggingface import HFLM

    class GqakitLM(HFLM):
        def loglikelihood(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not progress)

        def loglikelihood_rolling(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or not progress)

        def generate_until(self, requests: Any, disable_tqdm: bool = False) -> Any:
            return super().generate_until(requests, disable_tqdm=disable_tqdm or not progress)

    return GqakitLM


@contextmanager
def _task_bars(progress: bool) -> Iterator[None]:
    """The harness's "Building contexts" bars (plain tqdm in lm_eval.api.task) follow -q."""
    if progress:
        yield
        return
    import lm_eval.api.task as task_mod

    old = getattr(task_mod, "tqdm", None)
    if old is not None:
        task_mod.tqdm = functools.partial(old, disable=True)
    try:
        yield
    finally:
        if old is not None:
            task_mod.tqdm = old


@contextmanager
def sandboxed_templates() -> Iterator[None]:
    """Task templates (`doc_to_text`, ... in Jinja) render in Jinja's sandbox unless the verb
    was given --trust-remote-code: a plain Jinja template can reach Python (a function's
    `__globals__`) and run code, with no `!function` in sight."""
    if trust.allowed():
        yield
        return
    import lm_eval.utils as harness_utils
    from jinja2.sandbox import SandboxedEnvironment

    old = harness_utils.env
    env = SandboxedEnvironment(loader=old.loader, undefined=old.undefined,
                               keep_trailing_newline=old.keep_trailing_newline)
    env.filters.update(old.filters)
    harness_utils.env = env
    try:
        yield
    finally:
        harness_utils.env = old


@contextmanager
def _no_harness_provenance() -> Iterator[None]:
    """simple_evaluate records `git describe` of the current directory (printing git's
    "fatal: not a git repository" on stderr outside one) and runs `pip list` for its
    environment report. gqakit records its own provenance in `run`; both are skipped."""
    import lm_eval.evaluator as ev

    old = ev.get_git_commit_hash, ev.add_env_info
    ev.get_git_commit_hash = lambda: None
    ev.add_env_info = lambda results: None
    try:
        yield
    finally:
        ev.get_git_commit_hash, ev.add_env_info = old


# Task types an encoder-decoder is refused, and why. HFLM's seq2seq backend runs loglikelihood_rolling
# with one token in the encoder and the whole text in the decoder (its own TODO): the decoder alone.
SEQ2SEQ_REFUSED = {"loglikelihood_rolling": "lm-evaluation-harness scores it with one token in the encoder and "
                   "the whole text in the decoder, the decoder alone; for an encoder-decoder's perplexity use "
                   "`gqakit eval MODEL --data FILE` (span corruption) or --objective paired"}


def check_seq2seq_tasks(settings: TaskSettings) -> None:
    """Refuse, in one line and before the model loads, a task an encoder-decoder cannot run
    (SEQ2SEQ_REFUSED); the tasks were built by load_tasks."""
    tasks = settings.loaded if settings.loaded is not None else load_tasks(settings)
    for top in tasks:
        for task in (top.get_all_tasks() if hasattr(top, "get_all_tasks") else [top]):
            kind = getattr(task, "OUTPUT_TYPE", None)
            if kind in SEQ2SEQ_REFUSED:
                raise GqakitError(f"task {getattr(task, 'task_name', None) or task.config.task} is a {kind} task, "
                                  f"which an encoder-decoder cannot run here: {SEQ2SEQ_REFUSED[kind]}")


def run_tasks(model: Any, tokenizer: Any, settings: TaskSettings, *, progress: bool = True,
              quiet: bool = False) -> TasksResult:
    """Run the tasks on an already-loaded model; the `tasks` block of a results file. An
    encoder-decoder runs on the harness's seq2seq backend (`HFLM(backend="seq2seq")`)."""
    lm_eval = harness()
    tm = settings.manager or check_tasks(settings, quiet=quiet)
    tasks = settings.loaded or load_tasks(settings, quiet=quiet)
    settings.loaded = None  # simple_evaluate sets their few-shot count: one run per build
    backend = {"backend": "seq2seq"} if getattr(model.config, "is_encoder_decoder", False) else {}
    with harness_logs(quiet), offline_datasets(), sandboxed_templates(), _task_bars(progress), _no_harness_provenance():
        lm = _gqakit_lm(progress)(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size, **backend)
        try:
            out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=settings.num_fewshot,
                                          limit=settings.limit, task_manager=tm, log_samples=False,
                                          bootstrap_iters=settings.bootstrap_iters)
        except Exception as e:
            raise _explain(e, settings) from None
    if out is None:  # only on a non-zero rank of a multi-process launch
        raise GqakitError("lm-evaluation-harness returned no results (multi-process launch?)")
    return tasks_block(out, settings)


def _explain(e: Exception, settings: TaskSettings) -> GqakitError:
    """The harness's failure as one line; a dataset that is not local while offline says so."""
    text = f"{type(e).__name__}: {first_line(e)}"
    names = ", ".join(settings.tasks)
    if type(e).__name__ == "SecurityError":  # jinja2.sandbox: a template reached for Python internals
        return GqakitError(f"task {names}: a template of its task file reaches into Python ({text}); gqakit renders "
                           f"task templates in Jinja's sandbox unless {trust.FLAG} is given")
    offline_words = ("offline", "couldn't reach", "connection", "not found on the hub", "doesn't exist on the hub",
                     "no (more) internet", "cannot find the requested files in the local cache",
                     "couldn't find", "localentrynotfound")
    if is_offline() and any(w in (text.lower()) for w in offline_words):
        return GqakitError(f"task {names}: its dataset is not available offline ({text}). gqakit never downloads "
                           "from the Hub: use a local task (--tasks-path), or fetch the dataset once into the "
                           "datasets cache with HF_HUB_OFFLINE=0 (see README, Downstream tasks)")
    return GqakitError(f"lm-evaluation-harness failed on {names}: {text}")


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x in (float("inf"), float("-inf")):
        return None  # "N/A" stderr, NaN (one example), inf: no number
    return float(x)


def _metrics(res: dict[str, Any], higher: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"acc,none": v, "acc_stderr,none": s} -> {"acc": {"value": v, "stderr": s}}.

    A metric under a filter other than "none" keeps it: "exact_match,strict-match"."""
    metrics: dict[str, dict[str, Any]] = {}
    for key, value in res.items():
        if "," not in key or "_stderr," in key:
            continue
        metric, filt = key.split(",", 1)
        v = _num(value)
        if v is None:
            continue
        name = metric if filt == "none" else key
        metrics[name] = {"value": v, "stderr": _num(res.get(f"{metric}_stderr,{filt}")),
                         "higher_is_better": higher.get(metric)}
    return metrics


def _dataset(cfg: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {"path": cfg.get("dataset_path"), "name": cfg.get("dataset_name")}
    if cfg.get("dataset_path") in LOCAL_BUILDERS:
        files = []
        for f in _data_files(cfg):
            p = Path(f).expanduser()
            files.append({"path": str(p.resolve()) if p.is_file() else f,
                          "sha256": file_sha256(p) if p.is_file() else None})
        info["data_files"] = files
    return info


def tasks_block(out: dict[str, Any], settings: TaskSettings) -> TasksResult:
    """The harness's result dict -> gqakit's `tasks` block (JSON-safe, flat per task), typed."""
    from gqakit.eval.records import TasksResult

    results, versions = out.get("results", {}), out.get("versions", {})
    n_shot, n_samples, configs = out.get("n-shot", {}), out.get("n-samples", {}), out.get("configs", {})
    higher = out.get("higher_is_better", {})
    groups = set(out.get("groups", {})) | set(out.get("group_subtasks", {}))
    tasks: dict[str, Any] = {}
    group_rows: dict[str, Any] = {}
    for name, res in results.items():
        row: dict[str, Any] = {"version": versions.get(name), "metrics": _metrics(res, higher.get(name, {}))}
        if name in groups:
            row["subtasks"] = list(out.get("group_subtasks", {}).get(name, []))
            group_rows[name] = row
            continue
        cfg = configs.get(name, {})
        samples = n_samples.get(name, {})
        row.update(n_shot=n_shot.get(name), output_type=cfg.get("output_type"),
                   samples={"original": samples.get("original"), "effective": samples.get("effective")},
                   dataset=_dataset(cfg))
        tasks[name] = row
    return TasksResult.from_json({
        "format": TASKS_FORMAT,
        "harness": {"name": "lm-evaluation-harness", "package": "lm_eval", "version": harness_version()},
        "settings": {"tasks": list(settings.tasks), "num_fewshot": settings.num_fewshot, "limit": settings.limit,
                     "tasks_path": str(Path(settings.tasks_path).expanduser().resolve()) if settings.tasks_path else None,
                     "batch_size": settings.batch_size, "bootstrap_iters": settings.bootstrap_iters,
                     "seeds": {k: out.get("config", {}).get(k) for k in ("random_seed", "numpy_seed", "torch_seed",
                                                                         "fewshot_seed")}},
        "results": tasks,
        "groups": group_rows,
    })
