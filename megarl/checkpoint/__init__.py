"""The one checkpoint format (atomic save, ``latest`` pointer, plain metadata; ``format``, no torch) and a model's
weights in it (``weights``); used by conversion and training."""

from megarl.checkpoint.format import CheckpointError, holds_checkpoint, read_meta, write_meta

__all__ = ["CheckpointError", "holds_checkpoint", "read_meta", "write_meta"]
