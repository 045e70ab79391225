"""The two hidden-state streams of the calibration tokens: the original model's and the
converted-so-far model's, on the device, in host memory or in memory-mapped files."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor



class Streams:
    """The original and the converted hidden-state streams, [n_seq, T, D] each.

    `where`: "device" (the compute device), "cpu" (host memory) or "disk" (files in
    `folder`, memory-mapped, so the OS pages them in and out).
    """

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, where: str, device: str,
                 folder: Path | None = None) -> None:
        self.where, self.device, self.dtype = where, device, dtype
        numel = shape[0] * shape[1] * shape[2]
        if where == "disk":
            assert folder is not None
            folder.mkdir(parents=True, exist_ok=True)
            self.orig, self.new = (torch.from_file(str(folder / f"{name}.bin"), shared=True, size=numel,
                                                   dtype=dtype).view(shape) for name in ("orig", "new"))
        else:
            dev = device if where == "device" else "cpu"
            self.orig = torch.empty(shape, dtype=dtype, device=dev)
            self.new = torch.empty(shape, dtype=dtype, device=dev)

    @property
    def nbytes(self) -> int:
        return 2 * self.orig.numel() * self.orig.element_size()

    def get(self, which: str, sl: slice, dtype: torch.dtype) -> Tensor:
        return getattr(self, which)[sl].to(device=self.device, dtype=dtype)

    def put(self, which: str, sl: slice, value: Tensor) -> None:
        getattr(self, which)[sl].copy_(value)

    def save(self, folder: Path, chunk: int = 64) -> None:
        """Both streams as raw files `orig.bin`, `new.bin` (the resume state)."""
        for which in ("orig", "new"):
            t = getattr(self, which)
            with open(folder / f"{which}.bin", "wb") as f:
                for i in range(0, t.shape[0], chunk):
                    f.write(memoryview(t[i:i + chunk].cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))

    def load(self, folder: Path) -> None:
        for which in ("orig", "new"):
            t = getattr(self, which)
            saved = torch.from_file(str(folder / f"{which}.bin"), shared=False, size=t.numel(), dtype=t.dtype)
            t.copy_(saved.view(t.shape))
