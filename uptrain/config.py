"""The uptrain config: pydantic models, YAML or dict loading, and dotted overrides.

A run is described by one YAML file (or an equivalent dict from Python) with the
sections `model`, `teacher`, `data`, `train`, `eval`, `output` and `logging`. Every
model uses `extra="forbid"`, so a misspelt key is an error instead of a silently
ignored setting, and every failure becomes one `GqakitError` line that names the key.

Overrides on the command line use dotted keys: `train.tokens=2e6 output.dir=/tmp/x`.
Values are parsed as YAML scalars (`true`, `3e-4`, `[a.txt, b.txt]`, `null`).

The recipes shipped in `gqakit.configs` are named without `.yaml` (`stories260K-g2`): a
CONFIG that is no existing file, has no path separator and no `.yaml` ending is one of
them. They hold no path of any machine: what a run must be given (`model.path`, and
`teacher.path` or `data.files` where the recipe needs them) is left null, and every such
setting still missing after the overrides is named in one error line.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gqakit.core.errors import GqakitError
from gqakit.core.yamlfile import load_yaml_text, read_yaml


class _Section(BaseModel):
    # allow_inf_nan=False: `lr: .inf` or `nan` is refused here, not discovered at step 1.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelCfg(_Section):
    path: str = Field(description="folder written by `gqakit convert` (the student)")


class TeacherCfg(_Section):
    path: str | None = Field(None, description="the original (MHA) model; needed for kl_weight>0 or data.teacher_samples")
    kl_weight: float = Field(0.0, ge=0.0, description="weight of KL(teacher || student) added to the LM loss; 0 = off")
    temperature: float = Field(1.0, gt=0.0, description="softmax temperature of the KL term")
    lm_weight: float = Field(1.0, ge=0.0, description="weight of the next-token loss; 0 with kl_weight>0 = pure distillation")
    hidden_weight: float = Field(0.0, ge=0.0, description=(
        "weight of the MSE between the student's and the teacher's residual stream after every layer "
        "(mean over hidden units, summed over layers, per token); 0 = off"))
    layer_weight: float = Field(0.0, ge=0.0, description=(
        "weight of the layer-local (teacher-forced) MSE: each layer of the student is fed the teacher's "
        "input to that layer and must reproduce the teacher's output of it (mean over hidden units, "
        "summed over layers, per token); costs a second forward and backward of the student; 0 = off"))


class TeacherSamplesCfg(_Section):
    num: int = Field(gt=0, description="number of sampled sequences (split at BOS into documents)")
    length: int = Field(gt=1, description="new tokens per document")
    temperature: float = Field(1.0, gt=0.0)
    top_k: int | None = Field(None, gt=0)
    prompt: str = Field("", description="text each sample starts from (after BOS); empty = BOS only")
    batch_size: int = Field(128, gt=0)
    seed: int = 1234


class DataCfg(_Section):
    files: list[str] = Field(default_factory=list, description="local .txt/.jsonl/.json/.parquet files or globs")
    texts: list[str] | None = Field(None, description="in-memory documents (Python API)")
    hf_dataset: str | None = Field(None, description="a `datasets` hub name; needs internet")
    hf_config: str | None = None
    hf_split: str = "train"
    text_field: str = "text"
    sample_by: Literal["line", "paragraph", "document"] = Field(
        "paragraph", description="how a .txt file splits into documents")
    add_bos: bool = Field(False, description="prepend BOS to every document")
    add_eos: bool = Field(True, description="append EOS to every document, so EOS separates packed documents")
    objective: Literal["auto", "causal_lm", "span_corruption", "paired"] = Field("auto", description=(
        "auto: causal_lm for a decoder-only model; for an encoder-decoder, paired when data.files are JSON "
        "lines whose first row has data.input_field and data.target_field, else span_corruption"))
    noise_density: float = Field(0.15, gt=0.0, lt=1.0, description="span_corruption: share of tokens masked")
    mean_span_length: float = Field(3.0, ge=1.0, description="span_corruption: mean length of a masked span")
    input_field: str = Field("input", description="paired: the JSON field of the encoder's input text")
    target_field: str = Field("target", description="paired: the JSON field of the decoder's target text")
    teacher_samples: TeacherSamplesCfg | None = None
    eval_file: str | None = Field(None, description="held-out text for perplexity; never a training file")
    eval_texts: list[str] | None = None
    eval_max_blocks: int | None = Field(None, gt=0, description="cap on held-out blocks per eval")
    cache_dir: str | None = Field(None, description="tokenized data and teacher samples; default ~/.cache/gqakit")
    num_proc: int | None = Field(None, gt=0, description="tokenizer processes for datasets.map")

    @model_validator(mode="after")
    def _one_source(self) -> "DataCfg":
        n = sum([bool(self.files), self.texts is not None, self.hf_dataset is not None, self.teacher_samples is not None])
        if n == 0:
            raise ValueError("data: give one of data.files, data.texts, data.hf_dataset or data.teacher_samples")
        if n > 1:
            raise ValueError("data: give only one of data.files, data.texts, data.hf_dataset or data.teacher_samples")
        if self.eval_file is not None and self.eval_texts is not None:
            raise ValueError("data: give data.eval_file or data.eval_texts, not both")
        return self


class LoraCfg(_Section):
    r: int = Field(8, gt=0, description="rank of each adapter")
    alpha: float = Field(16.0, gt=0.0, description="adapter scale is alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")
    targets: list[str] | None = Field(None, min_length=1, description=(
        "module names (peft's rule: the name or its last dotted parts); null = the projections the "
        "conversion changed: K and V, also Q and O for the align methods"))


class TrainCfg(_Section):
    tokens: int | None = Field(None, gt=0, description="token budget; steps = tokens // tokens per optimizer step")
    alpha: float | None = Field(None, gt=0.0, le=1.0, description="fraction of pretrain_tokens (the paper: 0.05)")
    pretrain_tokens: int | None = Field(None, gt=0, description="the original model's pre-training tokens")
    seq_len: int = Field(512, gt=1)
    micro_batch: int = Field(8, gt=0, description="sequences per process per forward pass")
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step")
    lr: float = Field(3e-4, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine decays to lr * min_lr_ratio")
    warmup_steps: int | None = Field(None, ge=0, description="linear warm-up steps")
    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0, description="used when warmup_steps is not given")
    decay: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = Field(0.0, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    grad_clip: float | None = Field(1.0, gt=0.0, description="max global grad norm; null = off")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    seed: int = 0
    compile: bool = False
    gradient_checkpointing: bool = False
    trainable: list[str] | None = Field(None, description="regexes of parameter names to train (others frozen); null = all")
    lora: LoraCfg | None = Field(None, description=(
        "train low-rank adapters (peft) instead of the weights; merged into the exported model"))
    cpu: bool = Field(False, description="force CPU even when a GPU is present")

    @model_validator(mode="after")
    def _budget(self) -> "TrainCfg":
        if self.tokens is None and self.alpha is None:
            raise ValueError("train: give train.tokens, or train.alpha with train.pretrain_tokens")
        if self.tokens is not None and self.alpha is not None:
            raise ValueError("train: give train.tokens or train.alpha, not both")
        if self.alpha is not None and self.pretrain_tokens is None:
            raise ValueError("train.pretrain_tokens: needed with train.alpha")
        return self

    def budget(self) -> int:
        return self.tokens if self.tokens is not None else int(self.alpha * self.pretrain_tokens)


class EvalCfg(_Section):
    every: int = Field(0, ge=0, description="held-out perplexity every N optimizer steps; 0 = only at the end")
    micro_batch: int | None = Field(None, gt=0, description="default: train.micro_batch")


class OutputCfg(_Section):
    dir: str = Field(description="run folder: checkpoints/, log.jsonl and the final model/")
    save_every: int = Field(0, ge=0, description="accelerate.save_state every N optimizer steps; 0 = never")
    keep_last: int = Field(2, gt=0, description="checkpoints kept on disk")


class LoggingCfg(_Section):
    every: int = Field(10, gt=0, description="log a jsonl row every N optimizer steps")
    tensorboard: bool = Field(True, description="also log through accelerate's tensorboard tracker when installed")


class UptrainConfig(_Section):
    model: ModelCfg
    teacher: TeacherCfg = Field(default_factory=TeacherCfg)
    data: DataCfg
    train: TrainCfg
    eval: EvalCfg = Field(default_factory=EvalCfg)
    output: OutputCfg
    logging: LoggingCfg = Field(default_factory=LoggingCfg)

    @model_validator(mode="after")
    def _cross(self) -> "UptrainConfig":
        te = self.teacher
        if te.lm_weight == 0 and te.kl_weight == 0 and te.hidden_weight == 0 and te.layer_weight == 0:
            raise ValueError("teacher.lm_weight: 0 needs teacher.kl_weight > 0, or nothing is trained")
        for key in ("kl_weight", "hidden_weight", "layer_weight"):
            if getattr(te, key) > 0 and not te.path:
                raise ValueError(f"teacher.path: needed when teacher.{key} > 0")
        if te.layer_weight > 0 and self.train.gradient_checkpointing:
            # The teacher-forced pass swaps each layer's input in a hook; a checkpointed
            # layer re-runs its forward in the backward pass, after the hook is gone.
            raise ValueError("teacher.layer_weight: does not combine with train.gradient_checkpointing")
        if self.train.lora is not None and self.train.trainable is not None:
            raise ValueError("train.lora: does not combine with train.trainable (LoRA trains only its adapters)")
        if self.data.teacher_samples is not None and not te.path:
            raise ValueError("teacher.path: needed for data.teacher_samples")
        return self


# --------------------------------------------------------------------------- loading


def _section_fields(loc: Sequence[Any]) -> tuple[str, list[str]]:
    """The dotted section LOC's last part lives in, and that section's field names."""
    model: type[BaseModel] = UptrainConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = _model_of(field.annotation) if field is not None else None
        if sub is None:
            return "", []
        model = sub
    prefix = ".".join(str(p) for p in loc[:-1])
    return prefix, list(model.model_fields)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model of a field typed `Model` or `Model | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((a for a in getattr(annotation, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)),
                None)


def did_you_mean(loc: Sequence[Any]) -> str:
    """`; did you mean 'train.lr'?` for an unknown key LOC close to a field of its section, else ''."""
    prefix, names = _section_fields(loc)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    if not close:
        return ""
    return f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?"


def _format_error(e: ValidationError) -> str:
    """One line: the first failing key and why (an unknown key first: it explains the rest)."""
    errors = e.errors()
    err = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    key = ".".join(str(p) for p in err["loc"])
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return f"unknown config key {key!r}{did_you_mean(err['loc'])}"
    if err["type"] == "missing":
        return f"config key {key!r} is required"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        return msg if not key else f"{key}: {msg}"
    return f"config key {key!r}: {msg} (got {err.get('input')!r})"


def _given(tree: Any, *keys: str) -> Any:
    """tree[k1][k2]... or None where a level is missing or not a mapping."""
    for k in keys:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(k)
    return tree


def _positive(value: Any) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False  # not a number: validation names it


def missing_settings(tree: Mapping[str, Any]) -> list[str]:
    """The settings a run must be given that TREE leaves out or null: `model.path`,
    `output.dir`, `teacher.path` when a teacher term or teacher samples need it, and the
    data (named `data.files`) when no source is given."""
    def absent(*keys: str) -> bool:
        return _given(tree, *keys) in (None, "", [])

    te = _given(tree, "teacher") or {}
    needs_teacher = any(_positive(_given(te, k)) for k in ("kl_weight", "hidden_weight", "layer_weight")) \
        or not absent("data", "teacher_samples")
    no_data = _given(tree, "data") is None or isinstance(_given(tree, "data"), dict) and all(
        absent("data", k) for k in ("files", "texts", "hf_dataset", "teacher_samples"))
    wanted = [("model.path", absent("model", "path")), ("teacher.path", needs_teacher and absent("teacher", "path")),
              ("data.files", no_data), ("output.dir", absent("output", "dir"))]
    return [k for k, gone in wanted if gone]


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if any(not p for p in parts):
        raise GqakitError(f"bad override key {key!r}")
    node = tree
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise GqakitError(f"override {key!r}: {'.'.join(parts[:i + 1])} is not a section")
        node = nxt
    node[parts[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings; values are YAML scalars. Unknown keys fail in validation."""
    tree = copy.deepcopy(tree)
    for item in overrides:
        if "=" not in item:
            raise GqakitError(f"override {item!r} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        try:
            value = load_yaml_text(raw, f"override {key!r}") if raw != "" else None
        except yaml.YAMLError:
            value = raw
        # YAML 1.1 reads 2e6 as a string; accept scientific notation for numbers.
        if isinstance(value, str):
            try:
                f = float(value)
                value = int(f) if f.is_integer() and "." not in value else f
            except ValueError:
                pass
        _set_dotted(tree, key.strip(), value)
    return tree


def _coerce_numbers(tree: Any) -> Any:
    """YAML reads `2e6` or `3e-4` as strings; turn such strings into numbers."""
    if isinstance(tree, dict):
        return {k: _coerce_numbers(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_coerce_numbers(v) for v in tree]
    if isinstance(tree, str):
        try:
            f = float(tree)
        except ValueError:
            return tree
        if tree.strip().lower() in {"nan", "inf", "-inf", "infinity"}:
            return tree
        return int(f) if f.is_integer() and abs(f) < 2**63 else f
    return tree


# --------------------------------------------------------------------------- shipped recipes


def packaged_configs() -> dict[str, Path]:
    """The recipes shipped with gqakit (`gqakit.configs`), by name (the file name without `.yaml`)."""
    folder = Path(str(resources.files("gqakit.configs")))
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def config_summary(path: Path) -> str:
    """A recipe's one-line description: its first comment line."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    return line.strip().lstrip("#").strip() if line.lstrip().startswith("#") else ""
    except (OSError, UnicodeDecodeError):
        pass
    return ""


def is_config_name(config: str) -> bool:
    """Whether CONFIG names a shipped recipe rather than a file: no existing file, no path
    separator, no `.yaml`/`.yml` ending."""
    return not (Path(config).expanduser().exists() or "/" in config or "\\" in config
                or config.endswith((".yaml", ".yml")))


def resolve_config(config: str | Path) -> Path:
    """The file CONFIG stands for: the file itself, or the shipped recipe of that name."""
    text = str(config)
    if not is_config_name(text):
        path = Path(text).expanduser()
        if not path.is_file():
            raise GqakitError(f"config file not found: {path}")
        return path
    shipped = packaged_configs()
    if text in shipped:
        return shipped[text]
    close = difflib.get_close_matches(text, list(shipped), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise GqakitError(f"no config file and no shipped config named {text!r}; {hint}shipped: {', '.join(shipped)} "
                      "(gqakit uptrain --list-configs)")


def read_tree(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = resolve_config(config)
    tree = read_yaml(path)  # size and alias limits: a hostile file is one line, not a hang
    if not isinstance(tree, dict):
        raise GqakitError(f"{path} must hold a mapping of sections (model, data, train, ...)")
    return tree


def load_config(config: str | Path | Mapping[str, Any], overrides: Sequence[str] = ()) -> UptrainConfig:
    """Read, override and validate a config; every problem is one GqakitError naming the key.
    An unknown key is named first (it may be a misspelt required one), then every required
    setting still missing, then the first other problem."""
    tree = _coerce_numbers(apply_overrides(read_tree(config), overrides))
    try:
        cfg = UptrainConfig.model_validate(tree)
    except ValidationError as e:
        if not any(x["type"] == "extra_forbidden" for x in e.errors()):
            _check_missing(tree)
        raise GqakitError(_format_error(e)) from None
    _check_missing(tree)
    return cfg


def _check_missing(tree: dict[str, Any]) -> None:
    missing = missing_settings(tree)
    if missing:
        raise GqakitError(f"missing required settings: {', '.join(missing)} (give them as key=value overrides)")


def to_yaml(cfg: UptrainConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
