"""What an encoder-decoder's encoder reads at a speed grid point.

Token ids for a text encoder. For an encoder that the architecture table says reads audio
features (`encoder.features`), random features `[batch, bins, frames]`: the grid's input
lengths are then feature frames, the encoder's output (what the cross-attention cache holds)
has frames / `frames_per_position` positions, and the default input length is the longest
the encoder takes (its output positions x frames per position: Whisper's 30 s window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gqakit.core.loaded import find_loaded


@dataclass(frozen=True)
class EncoderInput:
    bins: int | None = None        # feature bins per frame; None: token ids
    frames_per_position: int = 1
    max_frames: int | None = None  # the longest input, in frames (features only)

    @property
    def features(self) -> bool:
        return self.bins is not None

    @property
    def name(self) -> str:
        """The keyword the encoder takes its input under."""
        return "input_features" if self.features else "input_ids"

    @property
    def unit(self) -> str:
        return "feature frames" if self.features else "tokens"

    def positions(self, input_len: int) -> int:
        """The encoder's output positions (the cross-attention cache's length) for an input of `input_len`."""
        return -(-input_len // self.frames_per_position)

    @property
    def probe_len(self) -> int:
        """An input length the encoder takes, for the one-step probes (short for token ids)."""
        return self.max_frames if self.features and self.max_frames else 4

    def random(self, batch: int, input_len: int, *, vocab: int, device: Any, dtype: Any) -> Any:
        """Random input of `input_len` tokens or frames."""
        import torch

        if self.features:
            return torch.randn(batch, self.bins, input_len, device=device, dtype=dtype)
        return torch.randint(0, vocab, (batch, input_len), device=device)

    def constant(self, batch: int, input_len: int, *, token: int, device: Any, dtype: Any) -> Any:
        """A constant input (`token` everywhere, or zero features)."""
        import torch

        if self.features:
            return torch.zeros(batch, self.bins, input_len, device=device, dtype=dtype)
        return torch.full((batch, input_len), token, device=device)


def encoder_input(model: Any) -> EncoderInput:
    """What MODEL's encoder reads, from its architecture table entry (token ids when not in the table)."""
    spec = find_loaded(model)
    f = spec.encoder.features if spec is not None and spec.encoder is not None else None
    if f is None:
        return EncoderInput()
    cfg = model.config
    return EncoderInput(int(getattr(cfg, f.bins)), f.frames_per_position,
                        int(getattr(cfg, f.positions)) * f.frames_per_position)
