"""Process-group initialisation on top of megatron ``parallel_state`` (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist

from megarl.compat import cpu as cpu_compat
from megarl.compat.cpu import megatron_mode
from megarl.parallel.layout import ParallelLayout


def default_backend() -> str:
    """NCCL for CUDA tensors when CUDA is usable (with gloo beside it for the small host-side collectives: metrics,
    flags, objects), gloo otherwise."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(layout: ParallelLayout, seed: int = 1234, timeout_s: float = 600.0) -> None:
    """Join the torchrun world (env://) and build Megatron's TP/PP/DP/EP groups for ``layout``; a collective on any of
    them waits at most ``timeout_s`` (``trainer.collective_timeout_s``; Megatron's groups in whole minutes).

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
    _destroy_megatron_groups()
    before = set(_process_groups())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        distributed_timeout_minutes=math.ceil(timeout_s / 60),
    )
    _MEGATRON_GROUPS.extend(g for g in _process_groups() if g not in before)
    rank = dist.get_rank()
    got = {
        "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
        "ep": dist.get_process_group_ranks(ps.get_expert_model_parallel_group()),
        "expert_dp": dist.get_process_group_ranks(ps.get_expert_data_parallel_group()),
    }
    want = {"tp": layout.tp_group(rank), "pp": layout.pp_group(rank), "dp": layout.dp_group(rank),
            "ep": layout.ep_group(rank), "expert_dp": layout.expert_dp_group(rank)}  # fmt: skip
    if got != want:
        raise RuntimeError(f"megatron groups {got} differ from ParallelLayout groups {want} on rank {rank}")
    with megatron_mode():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group."""
    _destroy_megatron_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


_MEGATRON_GROUPS: list = []
"""The process groups the last ``initialize_model_parallel`` created."""


def _process_groups() -> list:
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def _destroy_megatron_groups() -> None:
    """Megatron's groups destroyed, not only forgotten: ``destroy_model_parallel`` drops its references, but torch
    keeps every group (and, with gloo, its threads: ~3 per group and peer) until it is destroyed. A process that
    re-initialises for several layouts (conversion, the tests) piled up ~1,800 threads per rank that way."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    alive = set(_process_groups())  # a group torch already destroyed (with the default group) is not again
    while _MEGATRON_GROUPS:
        group = _MEGATRON_GROUPS.pop()
        if group in alive:
            dist.destroy_process_group(group)


_TIMEOUT_WORDS = ("timed out", "timeout")
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def describe_collective_timeout(exc: BaseException) -> str | None:
    """One line for a collective that timed out (gloo: ``Timed out waiting ...``, ``Application timeout ...``; NCCL's
    watchdog: ``... collective operation timeout``): the call, its group and its caller, read from the traceback;
    None for any other error."""
    if not any(w in str(exc).lower() for w in _TIMEOUT_WORDS):
        return None
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    at = next((i for i, f in enumerate(frames) if f.f_code.co_filename.endswith(_C10D)), None)
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if at is None:
        return f"a collective timed out ({detail}); a peer rank died, hangs, or is slower than the timeout"
    call = frames[at]
    group = call.f_locals.get("group")
    torch_dist = os.path.join("torch", "distributed") + os.sep
    caller = next((f for f in reversed(frames[:at]) if torch_dist not in f.f_code.co_filename), None)
    where = ""
    if caller is not None:
        where = f", called from {_short(caller.f_code.co_filename)}:{caller.f_lineno} ({caller.f_code.co_name})"
    return (
        f"{call.f_code.co_name} on {describe_group(group)} timed out{where}: {detail}; a peer rank died, hangs, or is "
        "slower than trainer.collective_timeout_s"
    )


def describe_group(group) -> str:
    """``TENSOR_MODEL_PARALLEL_GROUP (ranks [0, 1])``, ``the default group (ranks [0, 1])``, ``a group (ranks ..)``."""
    try:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    except Exception:  # the group may be gone with the failure
        ranks = "?"
    if group is None or group is dist.group.WORLD:
        return f"the default group (ranks {ranks})"
    desc = getattr(group, "group_desc", "") or ""
    return f"{desc if desc and desc != 'undefined' else 'a group'} (ranks {ranks})"


def _short(path: str) -> str:
    """A source path from its package folder on (``megarl/...``, ``megatron/...``, ``vllm/...``)."""
    parts = path.split(os.sep)
    for i, p in enumerate(parts):
        if p in ("megarl", "megatron", "vllm", "torch", "tests"):
            return "/".join(parts[i:])
    return path
