"""Stop requests: SIGTERM or SIGUSR1 (SLURM sends one before it kills a preempted job) only set a flag; the loop
finishes the current step, all ranks agree at the step boundary, save, and exit with ``EXIT_PREEMPTED``."""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """Context manager installing the handlers (main thread only); ``agreed()`` is collective."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> bool:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False

    def agreed(self, place) -> bool:
        """Collective over the launch (``place``: ``megarl.parallel.pools.Placement``, every pool): whether any rank
        was asked to stop."""
        return place.any(self.signal_name is not None)
