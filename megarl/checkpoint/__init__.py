"""The one checkpoint format (atomic save, ``latest`` pointer, plain metadata); used by conversion and training."""

from megarl.checkpoint.format import (
    CheckpointError,
    holds_checkpoint,
    load_model,
    read_meta,
    save_model,
    write_meta,
)

__all__ = ["CheckpointError", "holds_checkpoint", "load_model", "read_meta", "save_model", "write_meta"]
