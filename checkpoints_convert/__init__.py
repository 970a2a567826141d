"""Checkpoint conversion: HF folders -> converted folders (``convert``), JAX params -> HF
folders (``export_draft``, ``export_target``). CLI: ``python -m checkpoints_convert SRC OUT``."""

from checkpoints_convert.convert import convert
from checkpoints_convert.export import export_draft, export_target

__all__ = ["convert", "export_draft", "export_target"]
