"""Run a function on N gloo ranks (torch.multiprocessing spawn) and collect rank 0's return value."""

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
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
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


def run_on_ranks(fn, world: int, *args, timeout_s: float = 600):
    """Spawn ``world`` processes running ``fn(*args)`` under a gloo-ready env; return rank 0's result."""
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
