"""A user's reward function in worker processes: a hang, a crash, ``sys.exit`` or ``os._exit`` in it costs the
samples it was scoring, never the run.

Each rank holds a ``RewardPool`` of ``reward.num_workers`` processes (``megarl.rewards.worker``). Each loads the
function from its spec string, dies with the rank (``PR_SET_PDEATHSIG``), ignores the stop signals and leads its own
process group, so killing it also kills what it started (a sandbox, a judge client's helpers). A watchdog in that
group kills it when the rank's end of a pipe closes: what the reward started dies with the rank too.

``score`` gives each worker one contiguous chunk of the batch; ``submit`` queues one part of a batch (a prompt group
as the engine finishes it) and returns, ``finish`` collects every part's result. A call that raises (``SystemExit``
included), returns the wrong number of values, runs past ``reward.timeout_s`` or kills its worker is re-scored sample
by sample, each call under the same timeout, so only the offending samples fail. A worker that timed out, died or
raised ``SystemExit`` is replaced by a fresh one. ``score`` (``finish``) ends within ``budget_s`` (the other ranks
wait for it in a collective): samples still unscored then fail as timeouts. A pool is used from the thread that
created it (the rank's main thread: a worker dies with the thread that started it).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import megarl
from megarl.rewards.registry import RewardLoadError
from megarl.rewards.results import CANCELLED, ERROR, TIMEOUT, Failure, Outcome, ScoreResult, assemble, check_inputs

START_TIMEOUT_S = 120.0
"""Seconds a worker may take to start and import the reward's module."""
STOP_POLL_S = 0.2
"""How often ``finish`` looks at ``should_stop`` while it waits."""
MAX_DEFAULT_WORKERS = 8


def default_num_workers() -> int:
    """This rank's share of the cores it may run on (the node's ranks share them), 1 to MAX_DEFAULT_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(MAX_DEFAULT_WORKERS, cores // max(1, ranks_here)))


CREDENTIAL_NAME = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|APIKEY|KEY)(_|$)", re.IGNORECASE)
"""Environment variable names that look like credentials (``WANDB_API_KEY``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``,
``DB_PASSWORD``: a word of the name), kept from workers. Best effort: files a credential lives in (``~/.netrc``, the
Hugging Face token file) stay readable."""


def withheld_env(pass_env: tuple[str, ...] = ()) -> list[str]:
    """The variables of this process's environment that workers do not get (sorted)."""
    return sorted(k for k in os.environ if k not in pass_env and CREDENTIAL_NAME.search(k))


def _worker_env(pass_env: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without the credential-looking variables (but ``pass_env``'s)."""
    withheld = set(withheld_env(pass_env))
    env = {k: v for k, v in os.environ.items() if k not in withheld}
    env.pop("MEGARL_CPU_SHIM", None)  # a reward needs none of megatron's CPU patches (nor torch at start-up)
    root = os.path.dirname(os.path.dirname(os.path.abspath(megarl.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _how_it_ended(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


class RewardWorkerError(RuntimeError):
    """A reward worker could not start (its module hangs or crashes on import): this rank cannot score."""


class _Task:
    """Samples sent in one call; ``deadline`` (monotonic) once sent."""

    def __init__(self, indices: list[int]):
        self.indices = indices
        self.deadline = 0.0


@dataclass(frozen=True)
class WorkerLimits:
    """What a worker process may use (``reward.*`` / ``env.*`` of the same names)."""

    pass_env: tuple[str, ...] = ()
    """Credential-looking environment variables (``CREDENTIAL_NAME``) that still reach the worker."""
    max_memory_gb: float | None = None
    """Its address space in GB (RLIMIT_AS: an allocation past it raises MemoryError in the call); None: unlimited."""

    @classmethod
    def of(cls, cfg) -> WorkerLimits:
        """From ``reward.*`` or ``env.*`` (their ``pass_env`` and ``max_memory_gb``)."""
        return cls(tuple(cfg.pass_env), cfg.max_memory_gb)


class _Worker:
    """One worker process and the socket to it (started from the rank's main thread)."""

    def __init__(self, spec: str, kind: str, limits: WorkerLimits):
        mine, theirs = socket.socketpair()
        lifeline, self.lifeline = os.pipe()  # the worker's watchdog reads; only this process (and its forks) writes
        try:
            memory = int(limits.max_memory_gb * 2**30) if limits.max_memory_gb else 0
            cmd = [sys.executable, "-m", "megarl.rewards.worker", spec, str(theirs.fileno()), str(lifeline),
                   str(os.getpid()), kind, str(memory)]  # fmt: skip
            self.proc = subprocess.Popen(
                cmd, pass_fds=(theirs.fileno(), lifeline), stdin=subprocess.DEVNULL,
                env=_worker_env(limits.pass_env), process_group=0,
            )  # fmt: skip
        except BaseException:
            os.close(self.lifeline)
            mine.close()
            raise
        finally:
            theirs.close()
            os.close(lifeline)
        self.conn = Connection(mine.detach())
        self.exited = os.pidfd_open(self.proc.pid)
        """Readable once the process ended (the socket may stay open in what the reward forked)."""
        self.ready = False
        self.task: _Task | None = None
        self.start_deadline = time.monotonic() + START_TIMEOUT_S
        self.code: int | None = None

    def kill(self) -> int:
        """SIGKILL it and its process group (what the reward started), reap it (first: a zombie keeps its pid, so the
        group is not reused), close its descriptors; its exit status."""
        if self.code is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.code = self.proc.wait()
            for fd in (self.exited, self.lifeline):
                os.close(fd)
            self.conn.close()
        return self.code


class RewardPool:
    """``num_workers`` processes calling the reward function ``spec`` names; a context manager (``close`` kills
    them). Raises RewardLoadError when the function does not load in a worker."""

    def __init__(self, spec: str, *, num_workers: int, timeout_s: float, budget_s: float | None = None,
                 kind: str = "reward", limits: WorkerLimits = WorkerLimits()):  # fmt: skip
        if num_workers < 1:
            raise ValueError(f"a reward pool needs at least one worker, got {num_workers}")
        self.spec, self.timeout_s, self.budget_s, self.kind, self.limits = spec, timeout_s, budget_s, kind, limits
        """``kind``: 'reward' (``spec`` scores samples: ``ScoreResult``s) or 'calls' (``spec`` is any batch function
        ``fn(*lists) -> list``: each part's values, a failed call's as its ``Failure``; ``megarl.env``)."""
        self.timeout_key = "reward.timeout_s" if kind == "reward" else "env.timeout_s"
        """The setting a timed-out call's failure names."""
        self.restarts = 0
        """Workers replaced after a timeout, a death or a SystemExit."""
        self.thread = threading.current_thread()
        self.run: _Run | None = None
        """The parts submitted and not finished yet."""
        self.should_stop = None
        """A callable polled every ``STOP_POLL_S`` while ``finish`` waits: True cancels what is not scored yet (a
        run being stopped); None: never."""
        self.workers: list[_Worker] = []
        try:
            for _ in range(num_workers):
                self.workers.append(_Worker(spec, kind, limits))
            while not all(w.ready for w in self.workers):
                self._wait([w for w in self.workers if not w.ready], time.monotonic() + START_TIMEOUT_S, None)
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        per_step = f", {self.budget_s:g} s per step (reward.step_timeout_s)" if self.budget_s else ""
        workers = f"{len(self.workers)} worker process(es) per rank"
        withheld = withheld_env(self.limits.pass_env)
        kept = f"; without {', '.join(withheld)} (pass_env passes them)" if withheld else ""
        return f"{self.spec} in {workers}, {self.timeout_s:g} s per call{per_step}{kept}"

    def score(self, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]) -> ScoreResult:
        """Score the batch (see the module's doc). Deterministic if the function is: a sample's outcome does not
        depend on which worker scored it (unless the budget ran out)."""
        self._check_thread()
        check_inputs(prompts, responses, ground_truths, extras)
        if self.run is not None:  # parts of a round that failed before its finish: never answered here
            self.abandon()
        run = _Run()
        run.add((prompts, responses, ground_truths, extras), len(self.workers))
        return self._finish(run)[0]

    def submit(self, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict], *,
               calls: int = 1) -> None:  # fmt: skip
        """Queue one part of a batch (a prompt group the engine just finished) in ``calls`` calls, hand what idle
        workers can take to them and take the answers already there; returns at once. ``finish`` waits for the
        rest: the workers score while the caller goes on generating."""
        self._check_thread()
        check_inputs(prompts, responses, ground_truths, extras)
        self.submit_calls((prompts, responses, ground_truths, extras), calls)

    def submit_calls(self, args: tuple[list, ...], calls: int, tag=None) -> None:
        """``submit`` of any batch function's argument lists (``kind='calls'``); ``tag`` names the part for
        ``take_done``."""
        if self.run is None:
            self.run = _Run()
        self.run.add(args, calls, tag)
        self._guarded(lambda: self._advance(self.run, time.monotonic()))

    def take_done(self) -> list[tuple[object, list]]:
        """Without waiting (``kind='calls'``, a stream of parts that ``finish`` never ends): hand queued calls to idle
        workers, fail those past ``timeout_s``, and return the parts whose calls have all answered since the last
        call, as (tag, values); each part once."""
        run = self.run
        if run is None:
            return []
        self._guarded(lambda: self._advance(run, time.monotonic()))
        done = []
        for k, part in list(run.parts.items()):
            if all(o is not None for o in run.values(part)):
                done.append((run.tags[k], run.values(part)))
                run.forget(k)
        if not run.queue and not any(w.task for w in self.workers) and not run.parts:
            self.run = None  # every part taken: the next submit starts a new run (the lists do not grow forever)
        return done

    def finish(self) -> list[ScoreResult]:
        """Wait until every submitted part is scored (within ``budget_s`` from now); their results, in order."""
        run, self.run = self.run, None
        return self._finish(run) if run is not None else []

    def _finish(self, run: _Run) -> list[ScoreResult]:
        end = time.monotonic() + self.budget_s if self.budget_s else float("inf")

        def rest():
            while run.queue or any(w.task for w in self.workers):
                if time.monotonic() >= end:
                    self._give_up(run, self._late())
                    break
                if self.should_stop is not None and self.should_stop():
                    self._give_up(run, Failure(CANCELLED, "not scored: the run is stopping (SIGTERM/SIGUSR1)"))
                    break
                self._advance(run, end if self.should_stop is None else min(end, time.monotonic() + STOP_POLL_S))

        self._guarded(rest)
        if self.kind == "calls":
            return [run.values(part) for part in run.parts.values()]
        return [assemble(run.values(part), [run.args[0][i] for i in part]) for part in run.parts.values()]

    def _check_thread(self) -> None:
        if threading.current_thread() is not self.thread:
            raise RuntimeError("a RewardPool scores on the thread that created it (its workers die with that thread)")

    def _guarded(self, work) -> None:
        self._check_thread()
        try:
            work()
        except BaseException:  # interrupted (Ctrl-C): no call of this batch may answer into the next one
            self.abandon()
            raise

    def abandon(self) -> None:
        """Drop the parts submitted and not finished; their workers are replaced (no late answer)."""
        for w in list(self.workers):
            if w.task is not None:
                self._replace(w)
        self.run = None

    def _advance(self, run: _Run, end: float) -> None:
        """Hand queued calls to idle workers, then wait until one answers or ``end`` (now: just look)."""
        for w in self.workers:
            if w.ready and w.task is None and run.queue:
                self._send(w, run.queue.popleft(), run)
        busy = [w for w in self.workers if w.task or not w.ready]
        if busy:
            self._wait(busy, end, run)

    def _send(self, w: _Worker, task: _Task, run: _Run) -> None:
        args = run.args
        try:
            if w.proc.poll() is not None:
                raise OSError("the worker is gone")
            w.conn.send(tuple([a[i] for i in task.indices] for a in args))
        except OSError:  # it died while idle (an OOM kill): nothing ran, send it again
            run.queue.appendleft(task)
            self._replace(w)
            return
        task.deadline = time.monotonic() + self.timeout_s
        w.task = task

    def _wait(self, workers: list[_Worker], end: float, run: _Run | None) -> None:
        """Wait until a worker answers, or a deadline (a call's, a start's, ``end``) passes; handle what happened."""
        wake = min([end] + [w.task.deadline if w.task else w.start_deadline for w in workers])
        ready = wait([w.conn for w in workers] + [w.exited for w in workers], timeout=max(0.0, wake - time.monotonic()))
        now = time.monotonic()
        for w in workers:
            if w.conn in ready or w.exited in ready:
                self._receive(w, run)
            elif w.task and now >= w.task.deadline:
                task = w.task
                self._replace(w)
                run.failed(task, Failure(TIMEOUT, f"timed out after {self.timeout_s:g} s ({self.timeout_key})"))
            elif not w.ready and now >= w.start_deadline:
                raise RewardWorkerError(
                    f"a reward worker did not load {self.spec!r} within {START_TIMEOUT_S:g} s; does importing its "
                    "module hang?"
                )

    def _receive(self, w: _Worker, run: _Run | None) -> None:
        try:
            if not w.conn.poll():  # the process ended and said nothing more
                raise EOFError
            message = w.conn.recv()
        except (EOFError, OSError):  # it died: os._exit, a segfault, the OOM killer
            how = _how_it_ended(w.kill())
            task = w.task
            if not w.ready:
                raise RewardWorkerError(
                    f"a reward worker exited ({how}) while loading {self.spec!r}; see its output above"
                ) from None
            self._replace(w)
            if task is not None:
                whose = "reward" if self.kind == "reward" else "environment"
                run.failed(task, Failure(ERROR, f"killed its {whose} worker ({how})"))
            return
        kind = message[0]
        if kind == "ready":
            w.ready = True
        elif kind == "load_error":
            w.kill()
            raise RewardLoadError(message[1])
        elif kind == "done":
            task, w.task = w.task, None
            for i, got in zip(task.indices, message[1]):
                run.outcomes[i] = got
        else:  # "raised"
            task, w.task = w.task, None
            _, failure, fatal = message
            if fatal:  # SystemExit / KeyboardInterrupt: a fresh process for what comes next
                self._replace(w)
            run.failed(task, failure)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = _Worker(self.spec, self.kind, self.limits)
        self.restarts += 1

    def _late(self) -> Failure:
        return Failure(
            TIMEOUT,
            f"was not scored within this rank's {self.budget_s:g} s for the batch (reward.step_timeout_s: the other "
            "ranks wait meanwhile); raise it (and trainer.collective_timeout_s), or use more reward.num_workers",
        )

    def _give_up(self, run: _Run, late: Failure) -> None:
        """The budget ran out or the run is stopping: every sample not scored yet fails with ``late``; busy workers
        are replaced (their calls cancelled, not awaited)."""
        for w in list(self.workers):
            if w.task is not None:
                run.queue.append(w.task)
                self._replace(w)
        for task in run.queue:
            for i in task.indices:
                run.outcomes[i] = late
        run.queue.clear()

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


class _Run:
    """The parts submitted and not handed back: their inputs, the calls still to make, the outcomes so far (by sample
    index; a part handed back by ``take_done`` is dropped, so a stream of parts holds only those outstanding)."""

    def __init__(self):
        self.args: tuple[dict, ...] = ()
        self.outcomes: dict[int, Outcome | None] = {}
        self.parts: dict[int, range] = {}
        """Part number -> its sample indices, in submission order."""
        self.tags: dict[int, object] = {}
        self.queue: deque[_Task] = deque()
        self.size = self.count = 0
        """Samples and parts ever added (the next one's index and number)."""

    def values(self, part: range) -> list:
        return [self.outcomes[i] for i in part]

    def forget(self, k: int) -> None:
        """Part ``k`` was handed back: its inputs and outcomes are dropped."""
        for i in self.parts.pop(k):
            del self.outcomes[i]
            for a in self.args:
                del a[i]
        del self.tags[k]

    def add(self, args: tuple, calls: int, tag=None) -> None:
        """A part of ``len(args[0])`` samples, scored in ``calls`` contiguous calls (fewer if it is smaller)."""
        start, n = self.size, len(args[0])
        self.size += n
        self.args = self.args or tuple({} for _ in args)
        for mine, new in zip(self.args, args):
            mine.update(zip(range(start, start + n), new))
        self.outcomes.update(dict.fromkeys(range(start, start + n)))
        k, self.count = self.count, self.count + 1
        self.parts[k], self.tags[k] = range(start, start + n), tag
        chunks = min(calls, n)
        bounds = [start + n * j // chunks for j in range(chunks + 1)] if chunks else [start]
        self.queue.extend(_Task(list(range(a, b))) for a, b in zip(bounds, bounds[1:]))

    def failed(self, task: _Task, failure: Failure) -> None:
        """A call failed: a chunk is re-scored sample by sample; a single sample keeps the failure."""
        if len(task.indices) > 1:
            self.queue.extend(_Task([i]) for i in task.indices)
        else:
            self.outcomes[task.indices[0]] = failure
