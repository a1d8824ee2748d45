"""Stop requests: SIGTERM or SIGUSR1 (SLURM sends one before it kills a preempted job) only set a flag; nothing is
raised from the handler. A thread posts the flag on the launch's store at once, so a rank that did not get the signal
sees it too, and it is polled where a step waits: every few engine steps of a generation, inside the reward's waits.
A polling rank cuts its work short there (the engine aborts its requests, the reward workers are replaced, unscored
samples fail), so every collective that follows still happens in the same order on every rank; the ranks then agree
at fixed points (after each generation round and after validation's scoring, in the group that ran them, and at the
step boundary over the launch) and the loop abandons the rollout, or saves after the step, and exits with
``EXIT_PREEMPTED`` (``megarl.trainer.loop``). A rank installs the handlers first of all (before torch is imported),
so a signal during start-up stops the run too."""

from __future__ import annotations

import signal
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STORE_POLL_S = 0.5
"""How often a rank that got no signal looks at the store (one round trip to the launch's store)."""
_runs = {"count": 0}  # StopRequests connected in this process: the same count on every rank (one key per run)


class StepAbandoned(Exception):  # noqa: N818 -- a decision, not an error
    """Raised on every rank at the same point once they agreed to stop mid-step: ``where`` names what was cut."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


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
        self._previous = {}
        self._store, self._key, self._looked = None, None, 0.0
        self._raised = threading.Event()

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        self.since = self.since or time.monotonic()
        self._raised.set()  # the poster thread tells the other ranks, whatever this rank is doing

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> bool:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        self._raised.set()  # ends the poster thread
        return False

    def connect(self, store) -> None:
        """Share requests through ``store`` (the launch's: ``store_of``); once per run, on every rank (each run of a
        process gets its own key: tests run several on one process group)."""
        _runs["count"] += 1
        self._store, self._key = store, f"megarl/stop/{_runs['count']}"
        threading.Thread(target=self._post, name="megarl-stop-poster", daemon=True).start()

    def _post(self) -> None:
        """A thread: once this rank got a signal, post it on the store at once (the main thread may be in a long
        update or in a collective, where it polls nothing)."""
        self._raised.wait()
        if self.signal_name is not None:  # not just the run's end
            try:
                self._store.set(self._key, self.signal_name)
            except RuntimeError:  # the launch's store is gone (the run ended meanwhile): nobody is left to tell
                pass

    def requested(self, fresh: bool = False) -> bool:
        """Whether this rank got a signal or saw another rank's (not collective: for the polls inside waits; the
        store is asked at most every ``STORE_POLL_S`` unless ``fresh``)."""
        now = time.monotonic()
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


def store_of(place):
    """The store every rank of the launch reaches: torchrun's with pools (``place.pooled``), else the default
    group's."""
    from megarl.compat.torch_dist import default_store
    from megarl.parallel.pools import launch_store

    return launch_store() if place.pooled else default_store()
