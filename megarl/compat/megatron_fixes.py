"""Workarounds for megatron-core bugs that are not CPU-specific: always on, each gated by the versions it applies to.

- ``restore_tp_attributes`` (megatron-core 0.16.x): ``ColumnParallelLinear``, ``RowParallelLinear`` and
  ``VocabParallelEmbedding`` set their weights' ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``
  only inside the random-init helpers, which are skipped when ``perform_initialization=False`` (a model about to be
  loaded). Without the attribute, ``param_is_not_tensor_parallel_duplicate`` treats every TP rank > 0's shard as a
  replica, so the optimizer's gradient norm (and clipping by it) counts only TP rank 0's shards. Seen as a TP=2
  ``actor/grad_norm`` 26% below the single-rank value (tests/test_rl_update.py).
"""

from __future__ import annotations

AFFECTED_VERSIONS = ("0.16.",)


def _applies() -> bool:
    import megatron.core

    return megatron.core.__version__.startswith(AFFECTED_VERSIONS)


def restore_tp_attributes(model) -> int:
    """Give every TP-split weight of ``model`` the attributes random init would have set; returns how many."""
    if not _applies():
        return 0
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    split_dim = {ColumnParallelLinear: 0, VocabParallelEmbedding: 0, RowParallelLinear: 1}
    fixed = 0
    for module in model.modules():
        dim = next((d for cls, d in split_dim.items() if isinstance(module, cls)), None)
        weight = getattr(module, "weight", None)
        if dim is None or weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=getattr(module, "stride", 1))
        fixed += 1
    return fixed
