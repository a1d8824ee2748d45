"""Process lifetime: a run owns every process and every shared-memory segment it creates, and leaves none behind when
it ends, fails or is killed.

Identity. Every run (one per node: the segments are node-local) has a 12-hex-digit id, ``MEGARL_RUN_ID`` in the
environment of its processes. Everything the run puts in ``/dev/shm`` is named ``megarl-<id>...``: vLLM's CPU
communicator segments and its message queues (``megarl.compat.vllm_shm`` names them), the run's lock and one file per
rank.

Liveness, held by the kernel (so a SIGKILL releases it):
- ``megarl-<id>.lock``: every member of the run (the supervising parent and every rank) holds a shared lock on it for
  its whole life. The locks are POSIX record locks (``lockf``): they belong to the process and are not inherited by
  a forked child, so a helper a rank forks (a multiprocessing helper) never keeps a finished run's files alive. Whoever
  gets it exclusively knows the run is gone and removes its ``megarl-<id>*`` entries: the last member out, or the
  next run's sweep. A live run's entries are never touched;
- ``megarl-<id>.rank<N>``: rank N holds it exclusively while it runs and unlinks it when it finishes cleanly. A rank
  file that can be locked belongs to a rank that died without finishing: its supervisor kills the rest of the run.

Processes. The supervisor (``megarl train``'s local relaunch, ``megarl launch torchrun``, the SLURM node task,
``run_on_ranks``) starts its children from the main thread with ``PR_SET_PDEATHSIG=SIGKILL`` set in the child,
forwards SIGTERM/SIGUSR1 to the ranks (a graceful stop at the next step boundary) and SIGKILLs every process of the run
(its children and whatever carries the run's id) at once when one rank dies: a TP peer of a dead rank spins in vLLM's
shared-memory all-reduce, where no Python signal handler runs. Ranks also die with their parent (the torchrun agent),
and every process a rank forks dies with the rank (and is not a member of the run: it drops the inherited locks).
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import psutil

RUN_ENV = "MEGARL_RUN_ID"
"""The run's id, set by the supervisor for every process it starts."""
SUPERVISOR_ENV = "MEGARL_SUPERVISOR"
"""``<pid>:<start time>`` of the supervising parent: a rank started after it died exits at once."""
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "megarl-"
_ID = re.compile(r"megarl-([0-9a-f]{12})")
_RANK_FILE = re.compile(r"\.rank(\d+)$")
POLL_S = 0.2
EXIT_GRACE_S = 2.0
"""After a clean end, how long the run's last processes get to exit on their own before they are killed."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
"""The signals torchrun's agent handles (it kills its ranks on them): not SIGTERM, which stops the ranks."""

_PR_SET_PDEATHSIG = 1
_process = {"lease": None, "rank_file": None, "forks_die": False, "fork_hook": False, "held": set()}
"""This process's membership: its lease, rank file, fork settings and the runs whose lock it holds; not a cache."""


# --- kernel-level parent death -----------------------------------------------------------------------------------
def _prctl(option: int, value: int) -> None:
    if not sys.platform.startswith("linux"):
        return  # no prctl: the supervisor's kill on failure still applies
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def die_with_parent(parent_pid: int | None = None) -> None:
    """In a child: SIGKILL this process when the thread that started it ends. ``parent_pid``: exit now if that
    parent is already gone (it may have died before this call)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def _after_fork_in_child() -> None:
    """A forked child (a multiprocessing helper or manager) is not a member of the run (record locks are
    not inherited): it forgets the parent's membership; with ``forks_die`` it dies with the thread that forked it."""
    lease, rank_file = _process["lease"], _process["rank_file"]
    _process["lease"] = _process["rank_file"] = None
    _process["held"] = set()
    if lease is not None:
        lease.forget()
    if rank_file is not None:
        os.close(rank_file[0])
    if _process["forks_die"]:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def forks_die_with_this_process() -> None:
    """Every process this one forks from now on (multiprocessing helpers, a library's forked workers) gets SIGKILL
    when the forking thread ends. (``subprocess`` children are exec'ed without fork hooks: start them with
    ``preexec_fn=child_dies_with_parent(...)``.)"""
    _register_fork_hook()
    _process["forks_die"] = True


def _register_fork_hook() -> None:
    if not _process["fork_hook"]:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _process["fork_hook"] = True


def child_dies_with_parent():
    """A ``preexec_fn`` for ``subprocess.Popen`` (called from the main thread): the child dies with this process."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)


def process_token(pid: int) -> str:
    return f"{pid}:{psutil.Process(pid).create_time():.2f}"


def token_alive(token: str) -> bool:
    pid, _, started = token.partition(":")
    try:
        return f"{psutil.Process(int(pid)).create_time():.2f}" == started
    except (psutil.NoSuchProcess, ValueError):
        return False


# --- run identity and shared-memory entries ------------------------------------------------------------------------
def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def run_id() -> str:
    """This process's run: ``MEGARL_RUN_ID``, else (ranks started by a plain torchrun) one derived from the torchrun
    agent, the parent of every local rank, else this process."""
    if os.environ.get(RUN_ENV):
        return os.environ[RUN_ENV]
    owner = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    return hashlib.sha1(process_token(owner).encode()).hexdigest()[:12]


def shm_prefix(run: str | None = None) -> str:
    """The prefix of every shared-memory name of run ``run`` (default: this process's run)."""
    return f"{PREFIX}{run or run_id()}"


def _lock_path(run: str) -> str:
    return os.path.join(SHM_DIR, f"{shm_prefix(run)}.lock")


def run_entries(run: str) -> list[str]:
    """The names in ``SHM_DIR`` that belong to run ``run``."""
    prefix = shm_prefix(run)
    return sorted(n for n in _listdir() if n.startswith(prefix))


def _listdir() -> list[str]:
    try:
        return os.listdir(SHM_DIR)
    except OSError:
        return []


def _open_locked(path: str, how: int) -> int:
    """A descriptor of ``path`` (created if missing) holding ``lockf(how)``; retried when a cleaner removed the file
    between our open and our lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.lockf(fd, how)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _remove(name: str) -> None:
    path = os.path.join(SHM_DIR, name)
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except (FileNotFoundError, PermissionError):
        pass


def remove_if_gone(run: str) -> list[str]:
    """Remove run ``run``'s entries if no process of it is alive (its lock can be taken exclusively, or it has no
    lock: nothing of a run is created before its lock); the removed names, [] for a live run."""
    path = _lock_path(run)
    try:
        fd = os.open(path, os.O_RDWR)  # an exclusive record lock needs a writable descriptor
    except FileNotFoundError:
        fd = None
    except PermissionError:
        return []  # another user's run
    try:
        if fd is not None:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # EAGAIN/EACCES: a member holds it
                return []
        lock = os.path.basename(path)
        removed = [n for n in run_entries(run) if n != lock]
        for name in removed:
            _remove(name)
        if fd is not None:
            _remove(lock)
            removed.append(lock)
        return removed
    finally:
        if fd is not None:
            os.close(fd)


def sweep(keep: str | None = None) -> list[str]:
    """Remove what runs that are gone left in ``SHM_DIR`` (a killed run's segments); never a live run's, nor
    ``keep``'s. The removed names."""
    runs = {m.group(1) for m in map(_ID.match, _listdir()) if m}
    # a record lock never conflicts with its own process: a run this process holds must be skipped, not tested
    return [name for run in sorted(runs - {keep} - _process["held"]) for name in remove_if_gone(run)]


# --- membership of a run -------------------------------------------------------------------------------------------
class RunLease:
    """This process's membership of run ``run`` on this host: a shared lock on the run's lock file, held until
    ``release``; the last member out removes the run's entries."""

    def __init__(self, run: str):
        self.run = run
        self._fd: int | None = _open_locked(_lock_path(run), fcntl.LOCK_SH)
        _process["held"].add(run)

    def release(self, wait_s: float = 0.0) -> list[str]:
        """Leave the run; remove its entries once no other process of it is alive, waiting up to ``wait_s`` for the
        last ones to go (a killed rank's exit is not instant). The removed names."""
        self.forget()
        deadline = time.time() + wait_s
        removed = remove_if_gone(self.run)
        while not removed and run_entries(self.run) and time.time() < deadline:
            time.sleep(0.05)
            removed = remove_if_gone(self.run)
        return removed

    def forget(self) -> None:
        """Close this process's descriptor without cleaning up (a forked child that inherited it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            _process["held"].discard(self.run)


def join_run() -> RunLease:
    """Make this process a member of its run (idempotent; released at exit)."""
    if _process["lease"] is None:
        run = run_id()
        sweep(keep=run)
        _register_fork_hook()
        _process["lease"] = RunLease(run)
        atexit.register(leave_run)
    return _process["lease"]


def leave_run() -> None:
    lease, _process["lease"] = _process["lease"], None
    if lease is not None:
        lease.release()


def start_rank(rank: int, parent_pid: int | None = None) -> None:
    """First thing in a rank: die with the parent (and, under a megarl supervisor, exit at once if it is already
    gone), make forked helpers die with this rank, join the run and hold this rank's liveness file."""
    die_with_parent(parent_pid)
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if supervisor and not token_alive(supervisor):
        print(f"[megarl] rank {rank}: the launcher ({supervisor}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    forks_die_with_this_process()
    join_run()
    path = os.path.join(SHM_DIR, f"{shm_prefix()}.rank{rank}")
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = _open_locked(tmp, fcntl.LOCK_EX)
    os.write(fd, str(os.getpid()).encode())
    os.rename(tmp, path)  # visible to the supervisor only once locked
    _process["rank_file"] = (fd, path)


def finish_rank() -> None:
    """A rank's clean end: its liveness file goes (its supervisor then does not treat its exit as a death)."""
    held, _process["rank_file"] = _process["rank_file"], None
    if held is not None:
        fd, path = held
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        os.close(fd)


def dead_ranks(run: str) -> list[tuple[int, str]]:
    """(rank, pid) of every rank of run ``run`` on this host that ended without ``finish_rank``."""
    dead = []
    for name in run_entries(run):
        m = _RANK_FILE.search(name)
        if not m:
            continue
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except FileNotFoundError:
            continue  # finished meanwhile
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            dead.append((int(m.group(1)), os.read(fd, 32).decode() or "?"))
        except OSError:  # the rank holds it: alive
            pass
        finally:
            os.close(fd)
    return sorted(dead)


# --- the supervising parent ----------------------------------------------------------------------------------------
class Supervisor:
    """One node's share of a run, from the parent's side: a context manager around starting and watching the ranks.

    On entry: removes what runs that are gone left behind and starts a run (new id, its lease). ``env()`` is what
    every child needs; ``popen`` starts a child that dies with this process; ``watch`` polls until ``done()`` and
    SIGKILLs every process of the run at once when a rank died. On exit: kills what is left of the run (a helper that
    outlived its rank) and removes the run's shared-memory entries."""

    def __init__(self, *, say=None):
        self.run = new_run_id()
        self.say = say or _say
        self.lease: RunLease | None = None
        self.owned: set[int] = set()
        """The children this process started (the torchrun agent, or the ranks themselves)."""
        self.failure: str | None = None
        """The one-line account of a rank's death, once one died."""

    def __enter__(self) -> Supervisor:
        removed = sweep()
        if removed:
            self.say(f"[megarl] removed {len(removed)} shared-memory file(s) left in {SHM_DIR} by runs that are gone")
        self.lease = RunLease(self.run)
        return self

    def env(self) -> dict[str, str]:
        """The environment entries every process of the run starts with."""
        return {RUN_ENV: self.run, SUPERVISOR_ENV: process_token(os.getpid())}

    def popen(self, cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start a child (from the main thread) that dies with this process."""
        proc = subprocess.Popen(
            cmd, env={**(os.environ if env is None else env), **self.env()}, preexec_fn=child_dies_with_parent(),
            **kwargs,
        )  # fmt: skip
        self.owned.add(proc.pid)
        return proc

    def processes(self) -> list[psutil.Process]:
        """Every live process of this run on this host: the children it started and every process that carries
        the run's id in its environment (ranks, their helpers and children, wherever they were re-parented)."""
        me, procs = os.getpid(), {}
        for pid in self.owned:
            try:
                procs[pid] = psutil.Process(pid)
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter():
            if p.pid not in procs and p.pid != me:
                try:
                    if p.environ().get(RUN_ENV) == self.run:
                        procs[p.pid] = p
                except (psutil.Error, OSError):
                    pass
        return [p for p in procs.values() if _running(p)]

    def kill_all(self, spare: frozenset[int] = frozenset()) -> list[int]:
        """SIGKILL every process of the run but ``spare``; their pids."""
        victims = [p for p in self.processes() if p.pid not in spare]
        for p in victims:
            try:
                p.kill()
            except psutil.Error:
                pass
        return sorted(p.pid for p in victims)

    def watch(self, done, poll_s: float = POLL_S, spare: frozenset[int] = frozenset()) -> None:
        """Poll until ``done()``; when a rank died without finishing, SIGKILL the rest of the run but ``spare`` (the
        torchrun agent: it then reports which rank failed, and exits) at once and set (and say) ``failure``."""
        while not done():
            if self.failure is None:
                dead = dead_ranks(self.run)
                if dead:
                    killed = self.kill_all(spare)
                    who = ", ".join(f"rank {r} (pid {pid})" for r, pid in dead)
                    self.failure = (
                        f"{who} died without finishing; killed the {len(killed)} other process(es) of this run at "
                        f"once (pids {', '.join(map(str, killed)) or 'none'})"
                    )
                    self.say(f"[megarl] {self.failure}")
            time.sleep(poll_s)

    def __exit__(self, *exc) -> bool:
        grace = time.time() + (EXIT_GRACE_S if exc[0] is None and self.failure is None else 0)
        while self.processes() and time.time() < grace:  # e.g. a rank's resource tracker, ending on its own
            time.sleep(0.05)
        left = self.kill_all()
        if left and exc[0] is None and self.failure is None:
            self.say(f"[megarl] killed {len(left)} process(es) of this run that outlived it (pids {left})")
        self.lease.release(wait_s=10)  # a killed process's locks go when the kernel has reaped it
        return False


def _say(line: str) -> None:
    print(line, flush=True)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def supervise(cmd: list[str], *, env: dict[str, str] | None = None, label: str = "launcher", say=None) -> int:
    """Run ``cmd`` (torchrun: its agent, whose children are the ranks) as one node's share of a run; its exit
    status. SIGTERM/SIGUSR1 to this process go to the ranks (a graceful stop at the next step boundary), never to
    the agent: it dies of SIGUSR1 and on SIGTERM kills its workers after ``--shutdown-timeout`` (30 s), too short for
    a save and whatever ``trainer.stop_grace_s`` says. The agent starts with both ignored (SIG_IGN survives exec) and
    told not to handle SIGTERM (``PET_SIGNALS_TO_HANDLE``: SIGINT, SIGHUP, SIGQUIT still end it), so a signal to the
    whole process group or job step (``scancel``, a preemption, srun) leaves it running while its ranks, which
    install their own handlers first of all, stop and save. ``label`` names this process in what it says."""
    say = say or _say
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with Supervisor(say=say) as sup:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        # torchrun's per-run log directory (else a new /tmp/torchelastic_* per run, never removed) is the run's
        logs = os.path.join(SHM_DIR, f"{shm_prefix(sup.run)}-torchelastic")
        env = {"OMP_NUM_THREADS": "1", "PET_LOG_DIR": logs, "PET_SIGNALS_TO_HANDLE": AGENT_SIGNALS,
               **(os.environ if env is None else env)}  # fmt: skip
        agent = sup.popen(cmd, env=env)

        def forward(signum, frame):
            try:
                ranks = psutil.Process(agent.pid).children()
            except psutil.NoSuchProcess:
                return
            say(f"[megarl] {label}: {signal.Signals(signum).name} -> the {len(ranks)} rank(s) of torchrun {agent.pid}")
            for rank in ranks:
                try:
                    rank.send_signal(signum)
                except psutil.NoSuchProcess:
                    pass

        for s in STOP_SIGNALS:
            signal.signal(s, forward)
        try:
            sup.watch(lambda: agent.poll() is not None, spare=frozenset({agent.pid}))
            return agent.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
