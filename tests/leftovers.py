"""What megarl leaves on a machine: its processes (by command line or by the run id in their environment) and the
/dev/shm entries created since a snapshot. conftest.py takes the snapshot when the pytest session starts; the last
test of the suite compares (tests/test_lifetime.py)."""

from __future__ import annotations

import os

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


def snapshot() -> dict:
    return {"processes": megarl_processes(), "shm": set(os.listdir(SHM)) if os.path.isdir(SHM) else set()}
