"""Run a function on N local ranks (spawned processes, or this process when N == 1) and collect rank 0's result.

Used by the single-node tools (conversion, verify) and the multi-process tests. Each rank gets the env:// variables
torchrun would set, and OMP_NUM_THREADS=1 (ranks share the host's cores). Entry scripts need a __main__ guard.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, result_path: str, fn, args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        result = fn(*args)
    except BaseException:
        with open(f"{result_path}.err{rank}", "w") as f:
            f.write(traceback.format_exc())
        raise
    if rank == 0:
        torch.save(result, result_path)


def run_on_ranks(fn, world: int, *args):
    """Run ``fn(*args)`` on ``world`` ranks under a gloo/NCCL-ready env; return rank 0's result.

    With ``world == 1`` and no process group yet, it runs in this process (tools convert in one process by default).
    """
    if world == 1 and "RANK" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
        )
        return fn(*args)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.pt")
        try:
            mp.start_processes(
                _entry, args=(world, _free_port(), path, fn, args), nprocs=world, join=True, start_method="spawn"
            )
        except Exception as e:
            errors = [open(os.path.join(tmp, n)).read() for n in sorted(os.listdir(tmp)) if ".err" in n]
            raise RuntimeError("a rank failed:\n" + "\n".join(errors)) from e
        return torch.load(path, weights_only=False)
