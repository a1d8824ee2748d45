"""Run a function on N local ranks (spawned processes, or this process when N == 1) and collect rank 0's result.

Used by the single-node tools (conversion, verify) and the multi-process tests. Each rank gets the env:// variables
torchrun would set, and OMP_NUM_THREADS=1 (ranks share the host's cores). Entry scripts need a __main__ guard.
The ranks are one run (``megarl.lifetime``): they die with this process, a rank that dies takes the others
with it at once (no 30 s SIGTERM grace: a peer stuck in a collective never handles it), and the run's shared memory
is removed when it ends.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import socket
import sys
import tempfile
import threading
import traceback

import torch

from megarl import lifetime


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # stdout is the tools' answer (verify prints PASS/FAIL first)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, result_path: str, run_env: dict, parent: int, fn, args):
    os.environ.update(run_env)
    lifetime.start_rank(rank, parent_pid=parent)
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
    lifetime.finish_rank()
    _exit_cleanly()


def _exit_cleanly() -> None:
    """A finished rank's exit: the exit handlers (vLLM's shutdown, the run's lease), then ``os._exit(0)``, without
    the interpreter's teardown: there a process group's threads can abort the rank after its work is done (CI saw
    exit -6, SIGABRT, from a rank that had returned its result and ended cleanly)."""
    threading._shutdown()  # what the interpreter does first: its exit callbacks (thread pools), then the joins
    mp_util._exit_function()  # what multiprocessing runs after the target returns (finalizers, children)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
        lifetime.join_run()
        return fn(*args)
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _spawn(fn, world, args)
        except _PortTaken:
            if attempt == PORT_ATTEMPTS - 1:
                raise RuntimeError(f"the ranks' rendezvous port was taken {PORT_ATTEMPTS} times in a row") from None


PORT_ATTEMPTS = 3
"""The rendezvous port is free when chosen, but another process may bind it before rank 0 does (the ranks take
seconds to start): the ranks are then started again on a new port."""


class _PortTaken(RuntimeError):
    """Rank 0 could not listen on the rendezvous port (EADDRINUSE) before anything else ran."""


def _spawn(fn, world: int, args):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, lifetime.Supervisor(say=_note) as run:
        path = os.path.join(tmp, "result.pt")
        port = _free_port()
        procs = [
            ctx.Process(target=_entry, args=(rank, world, port, path, run.env(), os.getpid(), fn, args))
            for rank in range(world)
        ]
        for p in procs:
            p.start()
            run.owned.add(p.pid)
        run.watch(lambda: all(p.exitcode is not None for p in procs))
        for p in procs:
            p.join()
        failed = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            errors = [open(os.path.join(tmp, n)).read() for n in sorted(os.listdir(tmp)) if ".err" in n]
            if errors and all("EADDRINUSE" in e and "TCPStore(" in e for e in errors):
                raise _PortTaken()
            codes = ", ".join(f"rank {r}: exit status {c}" for r, c in failed)
            raise RuntimeError(f"a rank failed ({codes}; {run.failure or 'no rank died'}):\n" + "\n".join(errors))
        return torch.load(path, weights_only=False)
