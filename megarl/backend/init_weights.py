"""Where a job's initial weights come from: a HuggingFace directory or a megarl checkpoint directory.

Both give the HF config (for the ModelSpec and the rollout engine) and a tokenizer directory; the weights are
streamed into each rank's Megatron chunk (actor, reference, and the critic's body; its value head starts at zero).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megarl.checkpoint import format as ckpt
from megarl.models.spec import ModelSpec, read_hf_config
from megarl.parallel.layout import ParallelLayout

VALUE_HEAD_PREFIX = "output_layer."


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


def load_initial_weights(
    chunk, source: ModelSource, spec: ModelSpec, layout: ParallelLayout, rank: int, *, value_head: bool = False
) -> None:
    """Fill this rank's chunk from ``source`` (collective for checkpoints). A critic keeps its zero value head."""
    if source.is_checkpoint:
        ckpt.load_model(source.path, chunk, skip_prefixes=(VALUE_HEAD_PREFIX,) if value_head else ())
        return
    from megarl.convert.hf_to_megatron import load_hf_into_chunk

    load_hf_into_chunk(chunk, source.path, spec, layout, rank, progress=False, value_head=value_head)
