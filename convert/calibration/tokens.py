"""Calibration tokens: a text file or `hf:` dataset cut into sequences, or text sampled from
the source model itself (which needs the whole model in memory once)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from gqakit.convert.calibration.memory import empty_cache
from gqakit.convert.source import Opened, source_path
from gqakit.core import arch as archmod
from gqakit.core.device import available_memory
from gqakit.core.errors import GqakitError
from gqakit.core.run import show_bars
from gqakit.core.tokens import bos_id, sample_tokens


def _bos_id(config: dict[str, Any], tokenizer: Any = None) -> int:
    tid = bos_id(tokenizer, config, eos_fallback=True)
    if tid is None:
        raise GqakitError("cannot build calibration sequences: the model has neither a BOS nor an EOS token; "
                          "pass --calibration-data FILE")
    return tid


def _generation_config(opened: Opened) -> dict[str, Any]:
    p = Path(opened.folder) / "generation_config.json"
    try:
        return json.loads(p.read_text()) if not opened.gguf and p.is_file() else {}
    except (OSError, ValueError):
        return {}


def calibration_sequences(opened: Opened, data: str | None, tokens: int, seq_len: int, seed: int, *,
                          sample_batch: int = 64, device: str = "cpu", progress: bool | None = None,
                          source_params: int = 0) -> tuple[Tensor, str]:
    """Token ids [n_seq, seq_len] (each sequence starts with BOS) and where they came from."""
    progress = show_bars(progress)
    path = source_path(opened)
    cfg = {**opened.config, **{k: v for k, v in _generation_config(opened).items() if v is not None}}
    max_pos = archmod.max_positions(opened.config)
    seq_len = min(seq_len, max_pos) if max_pos else seq_len
    n_seq = max(1, math.ceil(tokens / seq_len))
    if data:
        from gqakit.core.loading import load_tokenizer
        from gqakit.core.text import read_text

        doc = read_text(str(data))
        tok = load_tokenizer(path)
        ids = tok(doc.text, add_special_tokens=False)["input_ids"]
        bos = _bos_id(cfg, tok)
        body = seq_len - 1
        if len(ids) < body:
            raise GqakitError(f"calibration data {doc.source} has {len(ids)} tokens, fewer than one sequence of "
                              f"{seq_len}")
        n_seq = min(n_seq, len(ids) // body)
        seqs = torch.tensor([[bos] + ids[i * body:(i + 1) * body] for i in range(n_seq)], dtype=torch.long)
        return seqs, f"{doc.source} ({n_seq} x {seq_len} tokens)"
    need = int(source_params * 4 * 1.2)  # float32 weights, plus room to generate
    free = available_memory(device)
    if need > free:
        raise GqakitError(f"sampling calibration text needs the whole model in memory ({need / 1e9:.1f} GB in "
                          f"float32, {free / 1e9:.1f} GB free on {device}); pass --calibration-data FILE "
                          f"(or hf:NAME[:CONFIG][:SPLIT])")
    from gqakit.core.loading import load_causal_lm

    bos = _bos_id(cfg)
    model = load_causal_lm(path, dtype=torch.float32, device=device, progress=progress)
    out = []
    eos = cfg.get("eos_token_id")
    eos = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    with torch.inference_mode(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # seeds the GPU's generator too
        for i in tqdm(range(0, n_seq, sample_batch), desc="sampling calibration text", disable=not progress):
            b = min(sample_batch, n_seq - i)
            # full-length sequences from the model's own distribution: EOS is never drawn
            gen = sample_tokens(model, [bos], b, seq_len - 1, never=eos).cpu()
            out.append(torch.cat([torch.full((b, 1), bos, dtype=torch.long), gen], dim=1))
    del model
    empty_cache(device)
    return torch.cat(out), f"sampled from the source model ({n_seq} x {seq_len} tokens, seed {seed})"


def span_rows(n_seq: int, seq_len: int, sl: slice, *, holdout: float, skip_first: int,
              device: str | torch.device = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """Rows of the calibration sequences `sl` (of `n_seq` sequences of `seq_len` tokens): those that
    enter the fits, those the drift is measured on, and the first positions of the measured
    sequences (align-refit's `holdout` and `skip_first`)."""
    n_hold = min(n_seq - 1, int(round(holdout * n_seq)))
    seq = torch.arange(sl.start, sl.stop, device=device).repeat_interleave(seq_len)
    p = torch.arange(seq_len, device=device).repeat(sl.stop - sl.start)
    held = seq >= n_seq - n_hold
    skip = p >= skip_first
    measure = (skip & held) if n_hold else skip
    first = (p == 0) & held if n_hold else (p == 0)
    return skip & ~held, measure, first
