"""gqakit.convert: MHA -> GQA conversion of Hugging Face checkpoints."""

from gqakit.convert.pipeline import convert_checkpoint

__all__ = ["convert_checkpoint"]
