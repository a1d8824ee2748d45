"""Per-phase wall-clock timers for one RL step (``timing/<phase>`` metrics)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates seconds per phase name; a phase entered twice in a step (dynamic sampling) adds up."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.seconds.items()}
