"""Fault injection for tests and drills, read from one environment variable (never set in normal runs):

    MEGARL_FAULT=<point>@<step>[,<point>@<step>...]

Points: ``generate`` (SIGKILL this process in the middle of that step's generation), ``save`` (SIGKILL in the middle
of that step's checkpoint save, after the shards are written and before the manifest), ``publish`` (SIGKILL after
the save's manifest, before its renames), ``replace`` (a step saved again: SIGKILL once the older ``iter_N`` is set
aside, before the new one is renamed in), ``prune`` (SIGKILL with an old checkpoint renamed for deletion and not yet
deleted), ``nan_loss`` (make that step's
actor loss NaN). Signals, as a scheduler's preemption sends them: ``sigterm`` (SIGTERM as that step starts: during
its generation), ``sigterm_reward`` (as the step waits for its scores, on the rollout's first rank),
``sigterm_update`` (as its update starts), ``sigterm_validate`` (as its validation starts, on the rollout's first
rank), ``sigterm_save`` (as the checkpoint of that step starts),
``sigterm_ahead`` (one-step-off: as the rollout pool starts generating that step's batch ahead, on its first rank),
``sigusr1`` (SIGUSR1 during start-up; its step is 0). Kills and signals fire on one rank: global rank 0 unless the
point names another (a launcher takes the other ranks down after a kill, as a node failure would; a signal reaches
the others through the store).

``reroute@<percent>`` is no step: a vLLM engine recording its routes (``actor.moe_routing_replay``) has its last
routed layer take an expert outside its top-k for about that percent of its tokens, and compute with it
(``megarl.compat.vllm_routes.reroute``; rollout routing replay's test).
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "MEGARL_FAULT"
POINTS = ("generate", "save", "publish", "replace", "prune", "nan_loss", "sigterm", "sigterm_reward",
          "sigterm_update", "sigterm_validate", "sigterm_save", "sigterm_ahead", "sigusr1", "reroute")  # fmt: skip


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


def fire(point: str, step: int, *, after_s: float = 0.0, here=None) -> None:
    """Kill (``generate``, ``save``, the publish's points) or signal (``sigterm*``, ``sigusr1``) this process if that
    fault is planned here; ``after_s > 0`` does it from a timer thread that much later (to land inside the call that
    follows); ``here()``: whether this is the rank to fire on (asked only when the fault is planned; default: global
    rank 0)."""
    if not at(point, step):
        return
    if not (here() if here is not None else int(os.environ.get("RANK", "0")) == 0):
        return
    sig = {"sigusr1": signal.SIGUSR1}.get(point, signal.SIGTERM if point.startswith("sigterm") else signal.SIGKILL)
    print(f"[megarl] fault injection: {point} at step {step}", flush=True)
    if after_s > 0:
        threading.Timer(after_s, os.kill, (os.getpid(), sig)).start()
    else:
        os.kill(os.getpid(), sig)
