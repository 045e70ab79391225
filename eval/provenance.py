"""Where a number comes from: the `run` and `model` blocks of a results file (eval/records.py).

`run_info` records the command, the library versions, the device, the date and the commit;
`model_info` the measured model's shape and the KV-cache bytes one token costs;
`seen_in_training` which of the model's own training files hold the evaluation text. Bench
scripts record the same `run` block next to their own numbers.
"""

from __future__ import annotations

import datetime as _dt
import platform
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gqakit.eval.records import ConversionInfo, EncoderInfo, ModelInfo, RunInfo

if TYPE_CHECKING:
    from gqakit.core.text import EvalText


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


def conversion_info(path: str | Path) -> ConversionInfo | None:
    """How gqakit made the model in folder `path`: its `gqakit_convert.json`'s method, G and grouping
    (and whether `gqakit uptrain` exported it); None where the folder has no readable record."""
    from gqakit.core.convrecord import read_conversion_record
    from gqakit.core.loading import UPTRAIN_SETTINGS

    folder = Path(path)
    record = read_conversion_record(folder)
    if record is None or record.settings.method is None or record.num_kv_heads is None:
        return None
    grouping = record.settings.grouping
    return ConversionInfo(method=record.settings.method, num_kv_heads=record.num_kv_heads,
                          **({"grouping": grouping} if grouping is not None else {}),
                          uptrained=(folder / UPTRAIN_SETTINGS).is_file())


def model_info(model: Any, path: str | Path, dtype_bytes: int) -> ModelInfo:
    """Shape facts of a loaded model, and the KV-cache bytes one token costs."""
    from gqakit.core.loaded import loaded_shape

    if getattr(model.config, "is_encoder_decoder", False):
        return seq2seq_model_info(model, path, dtype_bytes)
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
        conversion=conversion_info(path),
    )


def seq2seq_model_info(model: Any, path: str | Path, dtype_bytes: int) -> ModelInfo:
    """An encoder-decoder's shape facts: the decoder's (self- and cross-attention) in the usual
    fields, the encoder's apart, and both caches' bytes per token (core.loaded.loaded_seq2seq_shape)."""
    from gqakit.core.loaded import loaded_seq2seq_shape

    s = loaded_seq2seq_shape(model.config)
    dec, enc = s.decoder, s.encoder
    self_bytes, cross_bytes = s.cache_bytes(dtype_bytes, input_tokens=1, output_tokens=1)
    return ModelInfo(
        path=str(path),
        model_type=getattr(model.config, "model_type", None),
        parameters=sum(p.numel() for p in model.parameters()),
        layers=dec.num_layers,
        heads=dec.num_heads,
        kv_heads=dec.num_kv_heads,
        head_dim=dec.head_dim,
        max_positions=dec.max_positions,
        kv_bytes_per_token=self_bytes,  # the decoder's self-attention cache, per output token
        encoder=EncoderInfo(layers=enc.num_layers, heads=enc.num_heads, kv_heads=enc.num_kv_heads,
                            head_dim=enc.head_dim),
        cross_kv_bytes_per_token=cross_bytes,  # the cross-attention cache, per input token
        conversion=conversion_info(path),
    )


def seen_in_training(model_path: str | Path, doc: EvalText) -> list[dict[str, str]]:
    """Files the model's own records say it was trained or calibrated on that hold the
    evaluation text (equal content, or the text as a part): recorded with the result.

    Reads `gqakit_uptrain.yaml` (data.files) and `gqakit_convert.json` (calibration data)
    of a gqakit model folder; files that are gone or larger than 2 GB are skipped."""
    from gqakit.core.convrecord import read_conversion_record
    from gqakit.core.globs import bounded_glob
    from gqakit.core.text import TextSource

    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        return []
    candidates: list[tuple[str, str]] = []
    try:
        import yaml

        from gqakit.core.yamlfile import read_yaml  # limits: a hostile file is skipped, not a hang

        up = read_yaml(folder / "gqakit_uptrain.yaml") if (folder / "gqakit_uptrain.yaml").is_file() else {}
        pats = (((up or {}).get("settings") or {}).get("data") or {}).get("files") or []
        candidates += [(f, "uptrain data.files") for pat in pats if isinstance(pat, str)
                       for f in bounded_glob(pat)[0]]  # a folder's own record: no walk of the whole disk
        conv = read_conversion_record(folder)
        calib = conv.settings.calibration_data if conv is not None else None
        if calib is not None and not TextSource(calib).is_dataset:
            candidates.append((calib, "convert --calibration-data"))
    except (OSError, ValueError, AttributeError, TypeError, yaml.YAMLError):
        return []
    needle = doc.text.strip()
    found = []
    for f, what in dict.fromkeys(candidates):
        p = Path(f)
        try:
            if not p.is_file() or p.stat().st_size > 2 << 30:
                continue
            text = p.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
        except OSError:
            continue
        if needle and needle in text:
            found.append({"file": str(p.resolve()), "as": what})
    return found
