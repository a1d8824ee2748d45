"""Stop requests: SIGTERM or SIGUSR1 (SLURM sends one before it kills a preempted job) only set a flag; nothing is
raised from the handler. A thread woken by the signal itself (the wakeup pipe) posts it on the launch's store at once,
so a rank that did not get the signal sees it too, and it is polled where a step waits: every few engine steps of a
generation, inside the reward's waits. A polling rank cuts its work short there (the engine aborts its requests, the
reward workers are replaced, unscored samples fail), so every collective that follows still happens in the same order
on every rank; the ranks then agree at fixed points (after each generation round and after validation's scoring, in
the group that ran them, and at the step boundary over the launch) and the loop abandons the rollout, or saves after
the step, and exits with ``EXIT_PREEMPTED`` (``megarl.run.train``). A rank installs the handlers first of all
(before torch is imported), so a signal during start-up stops the run too (once its start-up is done: nothing is
cut there)."""

from __future__ import annotations

import os
import signal
import threading
import time

from megarl import faults

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STORE_POLL_S = 0.5
"""How often a rank that got no signal looks at the store (one round trip to the launch's store)."""
_runs = {"count": 0}  # StopRequests connected in this process: the same count on every rank (one key per run)
_installed = {"count": 0}  # StopRequests whose handlers are installed in this process now


class StopRequests:
    """Context manager installing the handlers (main thread only). ``requested()`` is local and cheap (polled inside
    waits); ``agreed()`` and ``agreed_here()`` are collective."""

    def __init__(self):
        self.signal_name: str | None = None
        """The signal this process got (None: none)."""
        self.since: float | None = None
        """``time.monotonic()`` when this process first saw a stop request (its own or another rank's)."""
        self.elsewhere = False
        """Another rank asked to stop (read from the store)."""
        self._previous, self._wakeup = {}, None
        self._store, self._poster, self._connect, self._key = None, None, None, None
        self._looked, self._posted = 0.0, False
        self._lock = threading.Lock()

    def _note(self, name: str) -> None:
        self.signal_name = self.signal_name or name
        self.since = self.since or time.monotonic()

    def _handle(self, signum, frame):  # runs on the main thread between bytecodes: only notes it (no lock)
        self._note(signal.Signals(signum).name)

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup = (write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(read,), name="megarl-stop", daemon=True).start()
            _installed["count"] += 1
        return self

    def __exit__(self, *exc) -> bool:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        if self._wakeup is not None:
            _installed["count"] -= 1
            write, before = self._wakeup
            self._wakeup = None
            try:
                current = signal.set_wakeup_fd(before)
                if current != write:  # another library took the wakeup fd meanwhile: leave it its own
                    signal.set_wakeup_fd(current)
            finally:
                os.write(write, b"\0")  # ends the watcher
                os.close(write)
        self._store = self._poster = None  # the store clients' connections close with the run
        return False

    def _watch(self, read: int) -> None:
        """A thread: Python runs signal handlers on the main thread only, once it is back in the interpreter (not
        while it waits in a collective or a kernel); the C-level handler writes each signal's number to the wakeup
        pipe at once. Note a stop signal and post it on the store, so the other ranks see it now."""
        while (got := os.read(read, 1)) and got[0] != 0:
            if got[0] in SIGNALS:
                self._note(signal.Signals(got[0]).name)
                self._post()
        os.close(read)

    def _post(self) -> None:
        """Post this rank's signal on the store, once (from the watcher, or from a poll on the main thread), through
        a client of its own: a client is busy while the main thread waits on it."""
        with self._lock:
            if self.signal_name is None or self._connect is None or self._posted:
                return
            self._posted = True  # once, reached or not: a store that is gone is not asked again at every poll
            try:
                self._poster = self._poster or self._connect()
                self._poster.set(self._key, self.signal_name)
            except RuntimeError:  # the launch's store is gone (the run ended meanwhile): nobody is left to tell
                pass

    def connect(self, connect) -> None:
        """Share requests through the launch's store; ``connect()`` makes a new client of it (``launch_store``).
        Once per run, on every rank (each run of a process gets its own key: tests run several on one process
        group). A signal already noted is posted."""
        _runs["count"] += 1
        self._connect, self._key = connect, f"megarl/stop/{_runs['count']}"
        self._store = connect()
        self._post()

    def requested(self, fresh: bool = False) -> bool:
        """Whether this rank got a signal or saw another rank's (not collective: for the polls inside waits; the
        store is asked at most every ``STORE_POLL_S`` unless ``fresh``)."""
        now = time.monotonic()
        if self.signal_name is not None:
            self._post()
        if not self.elsewhere and self._store is not None and (fresh or now - self._looked >= STORE_POLL_S):
            self._looked = now
            self.elsewhere = self._store.check([self._key])
        stop = self.signal_name is not None or self.elsewhere
        if stop and self.since is None:
            self.since = now
        return stop

    @property
    def by(self) -> str:
        return self.signal_name or "a signal on another rank"

    def agreed(self, place) -> bool:
        """Collective over the launch (``place``: ``megarl.parallel.pools.Placement``, every pool): whether any rank
        was asked to stop."""
        return place.any(self.requested(fresh=True))

    def agreed_here(self) -> bool:
        """Collective over this process's default group (the world colocated, the pool with pools: the ranks that
        generate and score together)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0 if self.requested(fresh=True) else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def took(self) -> str:
        """How long since this rank first saw the request."""
        return f"{time.monotonic() - self.since:.1f} s" if self.since is not None else "0.0 s"


def _forget_in_child() -> None:
    """A forked child (a multiprocessing helper) keeps the default stop signals and no wakeup pipe: a signal sent to it
    alone must not reach its parent's watcher as the parent's stop."""
    if _installed["count"]:
        try:
            signal.set_wakeup_fd(-1)
            for s in SIGNALS:
                signal.signal(s, signal.SIG_DFL)
        except ValueError:  # not the child's main thread: nothing of ours to undo there
            pass


os.register_at_fork(after_in_child=_forget_in_child)


def launch_store():
    """A new client of the launch's store (torchrun's TCPStore, at ``MASTER_ADDR:MASTER_PORT``; every pool reaches
    it): a connection of its own, free while other clients wait."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=60))  # fmt: skip


def installed_stop_requests() -> StopRequests:
    """A rank's stop requests, installed before it builds anything (the start-up fault drill fires here)."""
    stop = StopRequests().__enter__()  # left by ``train`` (which enters it again) as the rank ends
    faults.fire("sigusr1", 0)
    return stop
