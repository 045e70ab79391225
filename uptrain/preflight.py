"""Every check of an uptrain run that needs no torch, done before anything is written.

`preflight` reads the config and checks the model folder, the teacher, the data files
and globs, the eval file, the sizes against the model's positions, the output folder
(the shared rule of `core.outdir`: never an input, never around one; `--overwrite`
only replaces a run gqakit wrote) and, with `--resume`, the checkpoint and the settings
that fix the data order. It deletes and writes nothing, and it imports neither torch
nor transformers, so a wrong path or number is answered in a fraction of a second.
A run stops at the first problem; `--dry-run` hands in a `Problems` collector and gets
every problem at once (a check that needs what an earlier one refused is skipped).

`model.path` and `teacher.path` become folders in one place, `model_source`. Relative
paths (these, data files, `output.dir`) resolve against the working directory, whether
the config is a file or a shipped recipe.

The trainer then loads the model and data (more checks that need them) and only after
all of that deletes an old run (`--overwrite`) and creates the run folder.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gqakit.core.errors import GqakitError
from gqakit.core.arch import find as find_family, max_positions
from gqakit.core.hub import resolve_model_ref
from gqakit.core.modelfiles import weight_shapes
from gqakit.core.loading import UPTRAIN_SETTINGS, check_weights, is_gqakit_output, read_config_json, split_source
from gqakit.core.outrule import MODEL, RUN, check_not_an_input, check_output_path
from gqakit.core.yamlfile import YamlError, read_yaml
from gqakit.uptrain.checkpoint import CKPT_DIR, checkpoints, damage, damaged_message, file_sha256, read_state
from gqakit.uptrain.config import DataCfg, UptrainConfig, is_config_name, load_config, resolve_config

# Settings that fix the data order and the meaning of a step: a resumed run must match them.
RESUME_KEYS = ("seq_len", "micro_batch", "grad_accum", "seed")
# Data settings that change the token stream: a resumed run must match them too.
RESUME_DATA_KEYS = ("texts", "hf_dataset", "hf_config", "hf_split", "text_field", "sample_by", "add_bos", "add_eos",
                    "teacher_samples", "objective", "noise_density", "mean_span_length", "input_field", "target_field")


@dataclass
class Checked:
    """What preflight found: the resolved paths and how the run folder will be used."""

    cfg: UptrainConfig
    src: Path
    out: Path
    teacher: Path | None
    files: list[Path]
    eval_files: list[Path]
    mode: str                      # "fresh", "overwrite" or "resume"
    resume_step: int | None = None
    resume_state: dict[str, Any] = field(default_factory=dict)
    config_path: Path | None = None
    overrides: tuple[str, ...] = ()
    config_name: str | None = None  # a shipped recipe's name, as the command gave it

    def resume_command(self) -> str:
        """The command that continues this run."""
        cfg = self.config_name or (str(self.config_path) if self.config_path else "CONFIG.yaml")
        return " ".join(["gqakit uptrain", cfg, *self.overrides, "--resume"])


# ----------------------------------------------------------------------------- files


def resolve_files(patterns: Sequence[str], what: str = "data.files") -> list[Path]:
    """Expand globs; every pattern must match at least one non-empty file."""
    files: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(os.path.expanduser(pat), recursive=True))
        hits = [h for h in hits if Path(h).is_file()]
        if not hits:
            raise GqakitError(f"{what}: no file matches {pat!r}")
        files += [Path(h).resolve() for h in hits]
    for f in files:
        if f.stat().st_size == 0:
            raise GqakitError(f"{what}: {f} is empty")
    return list(dict.fromkeys(files))


def _same_content(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and file_sha256(a) == file_sha256(b)


def resolve_data(d: DataCfg) -> tuple[list[Path], list[Path]]:
    """The training files and the eval file that `data` names, resolved once: every glob
    matches a non-empty file, and held-out text is neither a training file nor a copy of one."""
    files = resolve_files(d.files) if d.files else []
    eval_files = resolve_files([d.eval_file], "data.eval_file") if d.eval_file else []
    for ef in eval_files:
        for tf in files:
            if ef == tf:
                raise GqakitError(f"data.eval_file: {ef} is also a training file; keep held-out text apart")
            if _same_content(ef, tf):
                raise GqakitError(f"data.eval_file: {ef} has the same content as the training file {tf}; "
                                  "keep held-out text apart")
    return files, eval_files


def _first_row(files: list[Path]) -> Any:
    """The first JSON row of the first JSON-lines file, or None."""
    if not files or files[0].suffix.lower() not in (".jsonl", ".json"):
        return None
    try:
        with files[0].open(encoding="utf-8") as f:
            line = next((ln for ln in f if ln.strip()), "")
        return json.loads(line)
    except (OSError, UnicodeDecodeError, ValueError):
        return None


# paired data: (suffixes, what they are) for a text encoder and an audio one
PAIRED_TEXT = ((".jsonl", ".json"), "JSON lines (.jsonl)")
PAIRED_FEATURES = ((".safetensors",), "features and target texts (.safetensors)")


def resolve_objective(cfg: UptrainConfig, encoder_decoder: bool, files: list[Path], src: Path,
                      teacher: Path | None) -> str:
    """`data.objective` with `auto` resolved for this model and data; every combination that
    cannot train is one line (the tokenizer's sentinels are checked once it is loaded)."""
    d, te = cfg.data, cfg.teacher
    obj = d.objective
    spec = find_family(read_config_json(src)) if encoder_decoder else None
    features = spec is not None and spec.encoder is not None and spec.encoder.features is not None
    if features:  # audio in: paired features and targets only
        if obj not in ("auto", "paired"):
            raise GqakitError(f"data.objective: {obj}; {src} reads audio features and trains on paired features "
                              "and target texts (.safetensors files, objective paired)")
        obj = "paired"
    if obj == "auto" and not encoder_decoder:
        obj = "causal_lm"
    elif obj == "auto":
        row = _first_row(files)
        paired = isinstance(row, dict) and d.input_field in row and d.target_field in row
        obj = "paired" if paired else "span_corruption"
    if not encoder_decoder:
        if obj != "causal_lm":
            raise GqakitError(f"data.objective: {obj} trains encoder-decoders, and {src} is a decoder-only model "
                              "(use causal_lm)")
        return obj
    if obj == "causal_lm":
        raise GqakitError(f"data.objective: causal_lm trains decoder-only models, and {src} is an encoder-decoder "
                          "(use span_corruption or paired)")
    if d.teacher_samples is not None:
        raise GqakitError("data.teacher_samples: not for an encoder-decoder; give data.files")
    for key in ("hidden_weight", "layer_weight"):
        if getattr(te, key) > 0:
            raise GqakitError(f"teacher.{key}: not for an encoder-decoder; distil its logits with teacher.kl_weight")
    if teacher is not None and not (teacher.is_dir() and read_config_json(teacher).get("is_encoder_decoder")):
        raise GqakitError(f"teacher.path: {teacher} is not an encoder-decoder, and model.path is one")
    if obj == "paired":
        kind = PAIRED_FEATURES if features else PAIRED_TEXT
        if not d.files:
            raise GqakitError(f"data.objective: paired reads input/target rows from data.files ({kind[1]})")
        if d.eval_texts is not None:
            raise GqakitError(f"data.eval_texts: paired data are held out in data.eval_file ({kind[1]})")
        for f in files:
            if f.suffix.lower() not in kind[0]:
                raise GqakitError(f"data.files: paired data are {kind[1]}, not {f.name}")
    return obj


# ----------------------------------------------------------------------------- the checks


def _saved_settings(out: Path) -> dict[str, Any]:
    p = out / UPTRAIN_SETTINGS
    if not p.is_file():
        return {}
    try:
        tree = read_yaml(p)
    except YamlError as e:
        raise GqakitError(f"--resume: the run's settings cannot be compared: {e}") from None
    return tree if isinstance(tree, dict) else {}


def _check_resume(cfg: UptrainConfig, out: Path) -> tuple[int, dict[str, Any]]:
    """The step to resume from and its state; the data's fingerprint is compared once tokenized."""
    ckpts = checkpoints(out)
    if not ckpts:
        raise GqakitError(f"--resume: no checkpoint in {out / CKPT_DIR}; start without --resume")
    saved = _saved_settings(out)
    old_train = saved.get("train") if isinstance(saved.get("train"), dict) else {}
    for k in RESUME_KEYS:
        if k in old_train and old_train[k] != getattr(cfg.train, k):
            raise GqakitError(f"--resume: train.{k} was {old_train[k]} in this run, now {getattr(cfg.train, k)}; "
                              "the data order would differ")
    new_lora = cfg.train.model_dump(mode="json")["lora"]
    if "lora" in old_train and old_train["lora"] != new_lora:  # the checkpoint holds adapters of that shape
        raise GqakitError(f"--resume: train.lora was {old_train['lora']} in this run, now {new_lora}")
    old_data = saved.get("data") if isinstance(saved.get("data"), dict) else {}
    new_data = cfg.data.model_dump(mode="json")
    for k in RESUME_DATA_KEYS:
        if k in old_data and old_data[k] != new_data.get(k):
            raise GqakitError(f"--resume: data.{k} differs from this run's; the training data would differ")
    step, ckpt = ckpts[-1]
    what = damage(ckpt)
    if what is not None:
        raise GqakitError(damaged_message(ckpt, what, out))
    state = read_state(ckpt)
    return step, state


class Problems:
    """Collects the one-line problems of checks run through it (`--dry-run`); without
    `collect` the first problem is raised as it is."""

    def __init__(self, collect: bool = True):
        self.collect = collect
        self.found: list[str] = []

    def run(self, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """CHECK's result, or None when it refused (the problem kept)."""
        try:
            return check(*args, **kwargs)
        except GqakitError as e:
            if not self.collect:
                raise
            self.found.append(e.one_line())
            return None


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two loaded tokenizers map text to the same ids (vocabulary, BOS and EOS)."""
    return a.get_vocab() == b.get_vocab() and (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id)


def model_source(value: str, key: str) -> Path:
    """The local folder (or .gguf file) a `model.path` / `teacher.path` value names: a local
    path, or a Hub id's snapshot in the Hugging Face cache (a local path of that name wins)."""
    try:
        return resolve_model_ref(value).path.expanduser().resolve()
    except GqakitError as e:
        raise GqakitError(f"{key}: {e}") from None


def _check_model(cfg: UptrainConfig) -> tuple[Path, dict[str, Any]]:
    src = model_source(cfg.model.path, "model.path")
    if not src.is_dir() or not (src / "config.json").is_file():
        raise GqakitError(f"model.path: {src} is not a model folder (no config.json)")
    if not is_gqakit_output(src):
        raise GqakitError(f"model.path: {src} is not a converted model (no gqakit_convert.json); run `gqakit convert` first")
    hf_cfg = read_config_json(src)
    split_source(src)  # its code, if not gqakit's own, needs --trust-remote-code
    check_weights(src)
    if weight_shapes(src) is None:
        raise GqakitError(f"model.path: {src} holds no weights (no .safetensors or .bin file)")
    return src, hf_cfg


def _check_seq_len(cfg: UptrainConfig, hf_cfg: dict[str, Any]) -> None:
    max_pos = max_positions(hf_cfg)
    if max_pos is not None and cfg.train.seq_len > max_pos:
        raise GqakitError(f"train.seq_len: {cfg.train.seq_len} is longer than the model's {max_pos} positions")


def _check_teacher(cfg: UptrainConfig) -> Path:
    teacher = model_source(cfg.teacher.path, "teacher.path")
    try:
        split_source(teacher)
    except GqakitError as e:
        raise GqakitError(f"teacher.path: {e}") from None
    if teacher.is_dir():
        check_weights(teacher)
    return teacher


def _check_paired_eval(eval_files: list[Path], files: list[Path]) -> None:
    """Held-out paired data of the training files' kind (JSON lines, or audio features)."""
    kind = PAIRED_FEATURES if files and files[0].suffix.lower() in PAIRED_FEATURES[0] else PAIRED_TEXT
    for f in eval_files:
        if f.suffix.lower() not in kind[0]:
            raise GqakitError(f"data.eval_file: paired data are {kind[1]}, not {f.name}")


def _check_out_folder(out: Path, inputs: list[tuple[str, Path | None]]) -> bool:
    check_not_an_input(out, inputs, "output.dir")
    if out.exists() and not out.is_dir():
        raise GqakitError(f"output.dir {out} is a file, not a folder")
    return True


def _check_existing_run(checked: Checked, inputs: list[tuple[str, Path | None]], overwrite: bool, resume: bool) -> None:
    out = checked.out
    if resume:
        checked.mode = "resume"
        checked.resume_step, checked.resume_state = _check_resume(checked.cfg, out)
        if (out / "model").exists():  # the final export replaces it: only if gqakit wrote it
            check_output_path(out / "model", overwrite=True, inputs=inputs, kind=MODEL, flag="output.dir/model")
    elif out.exists() and any(out.iterdir()):
        if not overwrite:
            raise GqakitError(f"output.dir {out} is not empty; pass --overwrite to replace it or --resume to continue")
        check_output_path(out, overwrite=True, inputs=inputs, kind=RUN, flag="output.dir")
        checked.mode = "overwrite"


def preflight(config: str | Path | Mapping[str, Any], overrides: Sequence[str] = (), *, overwrite: bool = False,
              resume: bool = False, problems: Problems | None = None) -> Checked:
    """All the checks that need no torch; writes nothing. Raises the first problem as one
    GqakitError, or with PROBLEMS collects them and goes on with every check that does not
    need what failed (a config that does not validate is still raised: nothing else can be
    read from it). `Checked.src` is None when the model was refused."""
    if overwrite and resume:
        raise GqakitError("--overwrite and --resume exclude each other")
    p = problems if problems is not None else Problems(collect=False)
    cfg = load_config(config, overrides)
    d = cfg.data
    config_path = None if isinstance(config, Mapping) else resolve_config(config).resolve()
    config_name = str(config) if isinstance(config, (str, Path)) and is_config_name(str(config)) else None

    # ---- the model and the teacher
    src, hf_cfg = p.run(_check_model, cfg) or (None, None)
    if hf_cfg is not None:
        p.run(_check_seq_len, cfg, hf_cfg)
    teacher = p.run(_check_teacher, cfg) if cfg.teacher.path else None
    teacher_ok = teacher is not None or not cfg.teacher.path

    # ---- data, and the objective it is trained on
    data = p.run(resolve_data, d)
    files, eval_files = data or ([], [])
    if src is not None and data is not None and teacher_ok:
        objective = p.run(resolve_objective, cfg, bool(hf_cfg.get("is_encoder_decoder")), files, src, teacher)
        if objective is not None:
            d.objective = objective
            if objective == "paired":
                p.run(_check_paired_eval, eval_files, files)

    # ---- the run folder: never an input, never around one
    out = Path(cfg.output.dir).expanduser().resolve()
    inputs: list[tuple[str, Path | None]] = [("model.path", src), ("teacher.path", teacher)]
    inputs += [("training file", f) for f in files] + [("data.eval_file", f) for f in eval_files]
    if d.cache_dir:
        inputs.append(("data.cache_dir", Path(d.cache_dir).expanduser()))
    if config_path is not None and not (resume and config_path == out / UPTRAIN_SETTINGS):
        inputs.append(("config file", config_path))
    checked = Checked(cfg, src, out, teacher, files, eval_files, "fresh", config_path=config_path,
                      overrides=tuple(overrides), config_name=config_name)
    if p.run(_check_out_folder, out, inputs):
        p.run(_check_existing_run, checked, inputs, overwrite, resume)
    return checked
