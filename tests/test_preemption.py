"""Stop requests (``megarl.run.preemption``): a signal only sets a flag; the flag reaches the other ranks through
the launch's store (a TCPStore here, as torchrun's), each run of a process has its own key, and the fault drills
name their signals. The stops through the real `megarl train` are in tests/test_resume.py, test_reward_stops.py and
test_requeue.py."""

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megarl import faults
from megarl.run import preemption
from megarl.run.preemption import STORE_POLL_S, StopRequests


class Launch:
    """The launch's store (as torchrun's) and ``connect``, which makes new clients of it (as ``launch_store``)."""

    def __init__(self):
        self.master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def connect(self):
        return dist.TCPStore("127.0.0.1", self.master.port, is_master=False)


@pytest.fixture
def store():
    return Launch()


def _ranks(store, n=2):
    """``n`` ranks' stop requests of one run: each rank's process connects its first run (the same key)."""
    ranks = [StopRequests() for _ in range(n)]
    for r in ranks:
        preemption._runs["count"] = 0  # as in a process of its own
        r.connect(store.connect)
    return ranks


def test_a_signal_sets_a_flag_that_another_rank_sees_through_the_store(store):
    signalled, other = _ranks(store)  # a run's two ranks share one key: connect in the same order
    with signalled:
        assert not signalled.requested() and not other.requested()
        os.kill(os.getpid(), signal.SIGUSR1)  # handled, not fatal: the process is still here
        assert signalled.signal_name == "SIGUSR1" and signalled.since is not None
        assert signalled.requested()  # posts it
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handlers are restored on exit
    deadline = time.monotonic() + 2 * STORE_POLL_S + 1
    while not other.requested():
        assert time.monotonic() < deadline, "the other rank never saw the stop"
        time.sleep(0.05)
    assert other.signal_name is None and other.by == "a signal on another rank"


def test_each_run_of_a_process_has_its_own_key(store):
    first = StopRequests()
    first.connect(store.connect)
    first.signal_name = "SIGTERM"
    assert first.requested()
    later = StopRequests()  # the next job on the same process group (tests reuse one)
    later.connect(store.connect)
    later._looked = 0.0
    assert not later.requested()


@pytest.mark.parametrize(
    "point, sig", [("sigterm", signal.SIGTERM), ("sigterm_reward", signal.SIGTERM), ("sigusr1", signal.SIGUSR1),
                   ("generate", signal.SIGKILL)],
)  # fmt: skip
def test_fault_drills_send_their_signal_on_the_rank_they_name(monkeypatch, point, sig):
    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, s: sent.append((pid, s)))
    monkeypatch.setenv(faults.ENV, f"{point}@3")
    monkeypatch.setenv("RANK", "1")
    faults.fire(point, 3)
    assert sent == []  # global rank 0 only, by default
    faults.fire(point, 3, here=lambda: True)
    faults.fire(point, 4, here=lambda: True)
    assert sent == [(os.getpid(), sig)]


def test_a_signal_is_posted_while_the_main_thread_waits_inside_a_collective(store):
    """The main thread blocked in C++ (a store wait, as in a gloo collective): Python runs no handler until it
    returns, yet the signal wakes the watcher thread, which posts it: the other rank sees it while the wait lasts."""
    signalled, other = _ranks(store)
    seen = []

    def another_rank():
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 1.5
        while not seen and time.monotonic() < deadline:
            if other.requested(fresh=True):
                seen.append(time.monotonic())
            time.sleep(0.02)

    with signalled:
        helper = threading.Thread(target=another_rank)
        helper.start()
        with pytest.raises(Exception):  # noqa: B017 -- the wait times out (torch's error type varies)
            signalled._store.wait(["never-set"], timedelta(seconds=2))  # the client the rank polls with
        returned = time.monotonic()
        helper.join()
    assert seen and seen[0] < returned - 0.2, (seen, returned)
    assert signalled.signal_name == "SIGTERM"


def test_a_forked_child_keeps_the_default_stop_signals():
    """A child forked while the handlers are installed (a checkpoint writer): a SIGTERM sent to it alone kills it
    and is not taken for the parent's stop."""
    stop = StopRequests()
    ready_r, ready_w = os.pipe()
    with stop:
        pid = os.fork()
        if pid == 0:  # the child: say it runs, then wait to be terminated
            os.write(ready_w, b"r")
            time.sleep(30)
            os._exit(0)
        assert os.read(ready_r, 1) == b"r"
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        time.sleep(0.2)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert stop.signal_name is None
