"""A model's weights in megarl's checkpoint format (``megarl.checkpoint.format``): saved and loaded collectively
through Megatron's dist_checkpointing, at whatever TP/PP the model was built with."""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from megarl.checkpoint.format import (
    FORMAT_VERSION,
    LATEST_FILE,
    CheckpointError,
    atomic_write,
    iter_dirname,
    latest_iteration_dir,
    read_meta,
)
from megarl.compat import checkpoint_writer
from megarl.compat.cpu import megatron_mode


def save_model(root: str, model_chunk, iteration: int = 0) -> str:
    """Collective: save every rank's shard of ``model_chunk`` as ``<root>/iter_N`` and point ``latest`` at it."""
    from megatron.core import dist_checkpointing

    final = os.path.join(root, iter_dirname(iteration))
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    checkpoint_writer.install()
    with megatron_mode():
        dist_checkpointing.save(
            model_chunk.sharded_state_dict(), tmp, content_metadata={"megarl_format_version": FORMAT_VERSION}
        )
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
        atomic_write(os.path.join(root, LATEST_FILE), iter_dirname(iteration) + "\n")
    dist.barrier()
    return final


def load_model(root: str, model_chunk, skip_prefixes: tuple[str, ...] = ()) -> None:
    """Collective: load the ``latest`` iteration into ``model_chunk`` at whatever TP/PP it was built with.

    Parameters whose names start with one of ``skip_prefixes`` are neither read nor required (a critic's value head
    where the checkpoint holds a language-model head)."""
    from megatron.core import dist_checkpointing

    meta = read_meta(root)
    if meta.get("lora"):
        raise CheckpointError(
            f"{root} holds LoRA adapters, not a whole model (their base: {meta.get('source')}); use the base as "
            "model.path and this checkpoint as trainer.resume, or export it (megarl convert megatron-to-hf --merge)"
        )
    path = latest_iteration_dir(root)
    with megatron_mode():
        wanted = {k: v for k, v in model_chunk.sharded_state_dict().items() if not k.startswith(skip_prefixes)}
        state = dist_checkpointing.load(wanted, path)
        # the result also holds the checkpoint's common (non-tensor) state: content_metadata and, in a training
        # checkpoint, the optimizers' and schedulers' plain entries
        state = {k: v for k, v in state.items() if k in wanted}
        missing, unexpected = model_chunk.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and not k.startswith(skip_prefixes)]
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing {missing}, unexpected {unexpected}")
