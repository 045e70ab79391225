"""An encoder-decoder's grid point (eval/speed/seq2seq.py): its typed state while open (its
measurements, once closed, are `point.summarize`'s, from `Seq2SeqBench.point_cost`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gqakit.eval.speed.point import OpenPoint

CACHES = "transformers.EncoderDecoderCache of two StaticCaches (self-attention, cross-attention; pre-allocated)"


@dataclass
class Seq2SeqPoint(OpenPoint):
    """An open encoder-decoder grid point: `prompt_len` is the input length."""

    output_len: int = 1
    encoded: Any = None        # the encoder's output, made once per point
    encode_s: float = 0.0      # the encoder's time
    first_s: float = 0.0       # encoder + decoder prefix: the time to the first token

    @property
    def axes(self) -> dict[str, int]:
        return {"batch": self.batch, "prompt_len": self.prompt_len, "output_len": self.output_len,
                "new_tokens": self.new_tokens}

