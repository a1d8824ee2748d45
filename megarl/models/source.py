"""What ``model.path`` is: a HuggingFace directory or a megarl checkpoint directory. Both give the HF config (for the
ModelSpec and the rollout engine) and a tokenizer directory."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megarl.checkpoint import format as ckpt
from megarl.models.spec import read_hf_config


@dataclass(frozen=True)
class ModelSource:
    """A model directory as megarl reads it."""

    path: str
    hf_config: dict
    tokenizer_dir: str
    is_checkpoint: bool
    """True for a megarl checkpoint (``megarl_checkpoint.json``), False for a HF directory."""


def model_source(path: str) -> ModelSource:
    """Read what ``model.path`` is; FileNotFoundError / CheckpointError name the path and the fix."""
    if ckpt.holds_checkpoint(path):
        meta = ckpt.read_meta(path)
        return ModelSource(path, meta["hf_config"], os.path.join(path, ckpt.TOKENIZER_DIR), True)
    return ModelSource(path, read_hf_config(path), path, False)
