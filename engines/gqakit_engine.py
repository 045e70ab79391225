"""The `gqakit` engine: gqakit's own decode runtime (`gqakit.runtime`) behind the engine protocol.

`gqakit eval --speed --engine gqakit` (the default) times the runtime's full fast path, packed
weights and the fused CPU layers included, through `eval.speed.DecodeBench`. This class is
the same runtime for what needs an `Engine` (the serving check, `EngineBench`): the model as
transformers loads it, its attention switched to `gqakit_sdpa`, whose decode steps run the
grouped attention (query heads as rows of their K/V head, no K/V copied up to all heads).
"""

from __future__ import annotations

from typing import ClassVar

from gqakit.engines.hf import TransformersEngine


class GqakitEngine(TransformersEngine):
    name: ClassVar[str] = "gqakit"
    formats: ClassVar[tuple[str, ...]] = ("folder", "gguf")

    def prepare(self) -> None:
        from gqakit.runtime.attention import use_gqa_attention

        super().prepare()
        self.attention = use_gqa_attention(self.model, "matmul")
