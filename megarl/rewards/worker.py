"""One reward worker process, started by ``megarl.rewards.worker_pool.RewardPool``:

    python -m megarl.rewards.worker SPEC FD LIFELINE PARENT_PID [KIND [MAX_BYTES]]

It dies with its parent (the rank), ignores the stop signals (the rank decides when the run stops: a SLURM
preemption signals every process of the job; a no-op handler, so that what the reward starts gets the default
handling back), forks a watchdog that kills this process group when the rank's end of the pipe ``LIFELINE`` closes
(what the reward started dies with the rank), loads the function ``SPEC`` names, says ``("ready",)`` on the socket
``FD``, then answers each ``(prompts, responses, ground_truths, extras)`` request with ``("done", outcomes)`` (KIND
``calls``: any argument lists, the values as they are) or
``("raised", failure, fatal)`` until the socket closes. ``fatal``: the call raised something that is not an
``Exception`` (``SystemExit``, ``KeyboardInterrupt``): the pool replaces this process. The user's prints go to the
rank's stdout and stderr; the protocol has its own socket. ``MAX_BYTES`` > 0 limits its address space (RLIMIT_AS,
set before the function loads): an allocation past it raises MemoryError in that call."""

from __future__ import annotations

import os
import resource
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from megarl.lifetime import STOP_SIGNALS, die_with_parent
from megarl.rewards.registry import RewardLoadError, load_reward_fn
from megarl.rewards.results import call, outcome, raised


def answer(fn, request: tuple, kind: str = "reward") -> tuple:
    """The reply to one request (a value whose conversion raises is the call's failure too): scores (``kind``
    'reward'), or the values as they are ('calls')."""
    try:
        values = call(fn, *request)
        return ("done", values if kind == "calls" else [outcome(v) for v in values])
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are the user's too
        return ("raised", raised(), not isinstance(e, Exception))


def _ignore(signum, frame) -> None:
    pass


def start_watchdog(lifeline: int, others: list[int]) -> None:
    """Fork a process of this group that SIGKILLs the whole group once every write end of ``lifeline`` is closed:
    the rank ended (this worker dies with it by PR_SET_PDEATHSIG; what the reward started would not)."""
    if os.fork() == 0:
        try:
            for fd in others:
                os.close(fd)
            while os.read(lifeline, 1):
                pass
        finally:
            os.killpg(0, signal.SIGKILL)
    os.close(lifeline)


def main(argv: list[str]) -> int:
    spec, fd, lifeline, parent = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    kind = argv[4] if len(argv) > 4 else "reward"
    if len(argv) > 5 and int(argv[5]) > 0:
        resource.setrlimit(resource.RLIMIT_AS, (int(argv[5]), int(argv[5])))
    die_with_parent(parent)
    for s in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(s, _ignore)
    start_watchdog(lifeline, [fd])
    conn = Connection(fd)
    try:
        fn = load_reward_fn(spec)
    except BaseException as e:  # noqa: BLE001 - an import that calls sys.exit is a load error too
        message = str(e) if isinstance(e, RewardLoadError) else traceback.format_exc().rstrip()
        conn.send(("load_error", message))
        return 1
    conn.send(("ready",))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the pool closed the socket: done
            return 0
        conn.send(answer(fn, request, kind))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
