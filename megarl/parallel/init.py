"""Process-group initialisation on top of megatron ``parallel_state`` (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megarl.compat import cpu as cpu_compat
from megarl.compat import megatron_mode
from megarl.parallel.layout import ParallelLayout


def default_backend() -> str:
    """NCCL for CUDA tensors when CUDA is usable (with gloo beside it for the small host-side collectives: metrics,
    flags, objects), gloo otherwise."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(layout: ParallelLayout, seed: int = 1234, timeout_s: float = 600.0) -> None:
    """Join the torchrun world (env://) and build Megatron's TP/PP/DP groups for ``layout``.

    Installs the CPU shim when CUDA is absent, checks that the launched world matches the layout, checks that
    Megatron's groups equal the layout's (so no other code needs to compute ranks), and seeds Megatron's RNG tracker.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cpu_compat.install_if_needed()
    if not dist.is_initialized():
        backend = default_backend()
        if "nccl" in backend:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"launched with {world} ranks but the layout {layout} needs {layout.world_size}: "
            f"start {layout.world_size} processes or change actor.parallel.{{tp,pp,dp}}"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
    rank = dist.get_rank()
    got = {
        "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
    }
    want = {"tp": layout.tp_group(rank), "pp": layout.pp_group(rank), "dp": layout.dp_group(rank)}
    if got != want:
        raise RuntimeError(f"megatron groups {got} differ from ParallelLayout groups {want} on rank {rank}")
    with megatron_mode():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
