"""vLLM's shared-memory names carry the run's identity (``megarl.lifetime``), so that runs on one host never
collide and a run's segments can be told apart and removed after a kill.

- ``_CPUSHMDistributed.make_group_name`` (the CPU communicator's segments ``<name>_<rank>``): vLLM builds the name from
  ``VLLM_DIST_IDENT``, which ``cpu_worker.py`` overwrites from the init method (``"//"`` for ``env://``, the external
  launcher's), plus the group's ranks, so every run on a host gets ``-tp:0-[0-1]-cpushm_<rank>``: a second run, or any
  run after a SIGKILL left them behind, fails with ``create shm in SHMManager failed. errno: 17``. Setting the variable
  does not help; the identifier is replaced by the run's prefix here.
- ``multiprocessing.shared_memory.SharedMemory`` (vLLM's message queues, tensor arenas and node probes create
  anonymous ``psm_<random>`` segments): a segment created without a name is named ``<prefix>-psm_<random>``.
- vLLM's ZMQ sockets (a message queue binds ``ipc://<VLLM_RPC_BASE_PATH>/<uuid>``, default ``/tmp``, and never
  unlinks it: two socket files per engine left in ``/tmp`` by every run) go to the run's directory
  ``<prefix>-ipc`` beside its segments, removed with them; a ``VLLM_RPC_BASE_PATH`` the user set is kept.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import shared_memory

from megarl.lifetime import SHM_DIR

_state = {"prefix": None}  # this process's run prefix, set once by install(); not a cache
_STDLIB_SHARED_MEMORY = shared_memory.SharedMemory


class RunNamedSharedMemory(_STDLIB_SHARED_MEMORY):
    """``SharedMemory`` whose anonymous segments are named after the run."""

    def __init__(self, name=None, create=False, size=0, **kwargs):
        while True:
            chosen = f"{_state['prefix']}-psm_{secrets.token_hex(4)}" if create and name is None else name
            try:
                super().__init__(chosen, create, size, **kwargs)
                return
            except FileExistsError:
                if name is not None:
                    raise


def run_group_name(make_group_name):
    def named(communicator) -> str:
        return _state["prefix"] + make_group_name(communicator).removeprefix(os.environ["VLLM_DIST_IDENT"])

    named.megarl_original = make_group_name
    return staticmethod(named)


def install(prefix: str) -> None:
    """Name this process's vLLM CPU communicator segments and anonymous shared memory after ``prefix`` (idempotent;
    a process belongs to one run)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    _state["prefix"] = prefix
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        os.environ["VLLM_RPC_BASE_PATH"] = os.path.join(SHM_DIR, f"{prefix}-ipc")
    os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], exist_ok=True)
    shared_memory.SharedMemory = RunNamedSharedMemory
    if not hasattr(_CPUSHMDistributed.make_group_name, "megarl_original"):
        _CPUSHMDistributed.make_group_name = run_group_name(_CPUSHMDistributed.make_group_name)
