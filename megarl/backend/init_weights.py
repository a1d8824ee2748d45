"""A job's initial weights, from a HuggingFace directory or a megarl checkpoint directory (``megarl.models.source``),
streamed into each rank's Megatron chunk (actor, reference, and the critic's body; its value head starts at zero).
"""

from __future__ import annotations

from megarl.checkpoint.weights import load_model
from megarl.models.source import ModelSource
from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout

VALUE_HEAD_PREFIX = "output_layer."


def load_initial_weights(
    chunk, source: ModelSource, spec: ModelSpec, layout: ParallelLayout, rank: int, *, value_head: bool = False
) -> None:
    """Fill this rank's chunk from ``source`` (collective for checkpoints). A critic keeps its zero value head."""
    if source.is_checkpoint:
        load_model(source.path, chunk, skip_prefixes=(VALUE_HEAD_PREFIX,) if value_head else ())
        return
    from megarl.convert.hf_to_megatron import load_hf_into_chunk  # here: convert imports the backend (verify)

    load_hf_into_chunk(chunk, source.path, spec, layout, rank, progress=False, value_head=value_head)
