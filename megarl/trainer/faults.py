"""Fault injection for tests and drills, read from one environment variable (never set in normal runs):

    MEGARL_FAULT=<point>@<step>[,<point>@<step>...]

Points: ``generate`` (SIGKILL this process in the middle of that step's generation), ``save`` (SIGKILL in the middle
of that step's checkpoint save, after the shards are written and before the manifest), ``nan_loss`` (make that step's
actor loss NaN), ``sigterm`` (send this process SIGTERM during that step, as a scheduler's preemption would).
Kills and signals fire on global rank 0 only (its launcher then takes the other ranks down, as a node failure would).
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "MEGARL_FAULT"
POINTS = ("generate", "save", "nan_loss", "sigterm")


def planned() -> dict[str, int]:
    """The faults this process was asked for: point -> step. A malformed value raises ValueError naming it."""
    spec = os.environ.get(ENV, "").strip()
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, step = item.partition("@")
        if point not in POINTS or not step.isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected <point>@<step> with point in {POINTS}, e.g. generate@5")
        out[point] = int(step)
    return out


def at(point: str, step: int) -> bool:
    """Whether fault ``point`` is planned for ``step``."""
    return planned().get(point) == step


def fire(point: str, step: int, *, after_s: float = 0.0) -> None:
    """Kill (``generate``, ``save``) or signal (``sigterm``) this process if that fault is planned here (rank 0);
    ``after_s > 0`` does it from a timer thread that much later (to land inside the call that follows)."""
    if not at(point, step) or int(os.environ.get("RANK", "0")) != 0:
        return
    sig = signal.SIGTERM if point == "sigterm" else signal.SIGKILL
    print(f"[megarl] fault injection: {point} at step {step}", flush=True)
    if after_s > 0:
        threading.Timer(after_s, os.kill, (os.getpid(), sig)).start()
    else:
        os.kill(os.getpid(), sig)
