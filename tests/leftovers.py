"""What megarl leaves on a machine: its processes (by command line or by the run id in their environment) and the
/dev/shm entries created since a snapshot. conftest.py takes the snapshot when the pytest session starts; the last
test of the suite compares (tests/test_lifetime.py)."""

from __future__ import annotations

import os
import time

import psutil
import pytest

SHM = "/dev/shm"
START = pytest.StashKey[dict]()


def _is_megarl(proc: psutil.Process) -> bool:
    args = proc.cmdline()
    named = any(a in ("megarl.cli", "megarl.launch.node", "torch.distributed.run") for a in args) or any(
        os.path.basename(a) in ("megarl", "torchrun") for a in args[:2]
    )
    return named or any(k in proc.environ() for k in ("MEGARL_RUN_ID", "MEGARL_TEST_RUN"))


def megarl_processes() -> dict[int, str]:
    """pid -> command line of every live megarl process but this one and its ancestors."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = {}
    for proc in psutil.process_iter():
        try:
            if proc.pid not in mine and proc.status() != psutil.STATUS_ZOMBIE and _is_megarl(proc):
                found[proc.pid] = " ".join(proc.cmdline())
        except (psutil.Error, OSError):
            pass
    return found


def tagged_processes(tag: str, select=lambda p: True) -> list[psutil.Process]:
    """The live processes of one test's run (launcher, torchrun, ranks, helpers, reward workers: all inherit
    ``MEGARL_TEST_RUN=tag``) that ``select`` keeps."""
    procs = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MEGARL_TEST_RUN") == tag and proc.status() != psutil.STATUS_ZOMBIE and select(proc):
                procs.append(proc)
        except (psutil.Error, OSError):
            pass
    return procs


def alive_after(tag: str, within_s: float, select=lambda p: True) -> list[psutil.Process]:
    """``tagged_processes`` still alive after up to ``within_s`` seconds of waiting for them to end."""
    deadline = time.monotonic() + within_s
    while tagged_processes(tag, select) and time.monotonic() < deadline:
        time.sleep(0.05)
    return tagged_processes(tag, select)


def snapshot() -> dict:
    return {"processes": megarl_processes(), "shm": set(os.listdir(SHM)) if os.path.isdir(SHM) else set()}
