"""Process lifetime (megarl/lifetime.py) with real processes: a dead run's shared memory is swept and a live
one's never; children die with their parent at kernel level (also helpers a rank forks); the supervisor SIGKILLs the
rest of a run at once when a rank dies (a peer that ignores SIGTERM included) and removes the run's segments; a
collective that times out is reported in one line naming the call, the group and the caller. The same mechanisms with
the real trainer and vLLM at TP=2: tests/test_resume.py."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from megarl import lifetime
from megarl.parallel.spawn import run_on_ranks
from tests import leftovers

PY = sys.executable


def _wait_gone(pids, timeout_s=10.0):
    """The pids still alive after ``timeout_s`` (zombies count as gone)."""
    deadline = time.time() + timeout_s
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.05)


def _child(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([PY, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, **kw)


def test_sweep_removes_what_a_dead_run_left_and_never_a_live_runs():
    member = """
        import os, sys, time
        from megarl import lifetime
        lifetime.join_run()
        open(os.path.join(lifetime.SHM_DIR, lifetime.shm_prefix() + "-psm_test"), "w").close()
        print(lifetime.run_id(), flush=True)
        time.sleep(60)
    """
    env = {**os.environ, lifetime.RUN_ENV: lifetime.new_run_id()}
    proc = _child(member, env=env)
    run = proc.stdout.readline().strip()
    try:
        assert run == env[lifetime.RUN_ENV]
        entries = lifetime.run_entries(run)
        assert entries == [f"megarl-{run}-psm_test", f"megarl-{run}.lock"]
        assert lifetime.sweep() == [] and lifetime.run_entries(run) == entries  # alive: untouched
    finally:
        proc.kill()
        proc.wait()
    assert sorted(lifetime.sweep()) == entries  # gone (SIGKILL: no cleanup of its own)
    assert lifetime.run_entries(run) == []


def test_a_sweep_never_removes_a_run_this_process_holds():
    """Record locks never conflict within one process: a supervisor that sweeps must skip its own runs."""
    with lifetime.Supervisor(say=lambda line: None) as outer:
        assert outer.run not in {n[len("megarl-") :][:12] for n in lifetime.sweep()}
        assert f"megarl-{outer.run}.lock" in lifetime.run_entries(outer.run)
    assert lifetime.run_entries(outer.run) == []


def test_the_last_member_out_removes_the_runs_entries_even_with_a_forked_helper_alive():
    """A forked helper (megatron's checkpoint writers, a multiprocessing manager) is not a member: the member's exit
    cleans up at once, while the helper still runs."""
    env = {**os.environ, lifetime.RUN_ENV: lifetime.new_run_id()}
    code = """
        import os, time
        from megarl import lifetime
        lifetime.join_run()
        open(os.path.join(lifetime.SHM_DIR, lifetime.shm_prefix() + "-cpushm_0"), "w").close()
        helper = os.fork()
        if helper == 0:
            time.sleep(30)
            os._exit(0)
        print(helper, flush=True)
    """
    proc = _child(code, env=env)
    helper = int(proc.stdout.readline())
    try:
        deadline = time.time() + 10
        while lifetime.run_entries(env[lifetime.RUN_ENV]) and time.time() < deadline:
            time.sleep(0.05)
        assert lifetime.run_entries(env[lifetime.RUN_ENV]) == []
        assert psutil.pid_exists(helper)
    finally:
        os.kill(helper, signal.SIGKILL)
        proc.wait()


def test_children_and_forked_helpers_die_with_their_parent():
    """parent --Popen(preexec: die with parent)--> child --fork (at-fork hook)--> helper: SIGKILL the parent, and
    the child, then the helper, die (a rank's checkpoint writers die with the rank)."""
    parent = """
        import multiprocessing as mp, subprocess, sys, time
        from megarl import lifetime
        child = '''
        import multiprocessing as mp, time
        from megarl import lifetime
        lifetime.forks_die_with_this_process()
        helper = mp.get_context("fork").Process(target=time.sleep, args=(60,))
        helper.start()
        print(helper.pid, flush=True)
        time.sleep(60)
        '''
        p = subprocess.Popen([sys.executable, "-c", child], preexec_fn=lifetime.child_dies_with_parent(),
                             stdout=subprocess.PIPE, text=True)
        print(p.pid, p.stdout.readline().strip(), flush=True)
        time.sleep(60)
    """
    proc = _child(parent)
    child, helper = map(int, proc.stdout.readline().split())
    assert _wait_gone([child, helper], timeout_s=0.5) == [child, helper]  # both alive
    proc.kill()
    proc.wait()
    assert _wait_gone([child, helper], timeout_s=5) == []


def test_vllm_shared_memory_names_carry_the_run():
    """compat.vllm_shm: without it, vLLM's CPU communicator names its segments from the init method ("//" for env://)
    and the group's ranks only, the same for every run on a host (errno 17 for the next run after a kill); with it,
    the communicator's and the anonymous message-queue segments start with the run's prefix."""
    code = """
        import os
        from multiprocessing import shared_memory
        from types import SimpleNamespace
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
        from megarl.compat import vllm_shm
        os.environ["VLLM_DIST_IDENT"] = "//"  # what cpu_worker.py sets under the external launcher
        group = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
        before = _CPUSHMDistributed.make_group_name(group)
        vllm_shm.install("megarl-0123456789ab")
        vllm_shm.install("megarl-0123456789ab")  # idempotent
        after = _CPUSHMDistributed.make_group_name(group)
        shm = shared_memory.SharedMemory(create=True, size=64)
        named = shared_memory.SharedMemory(name="given-by-caller", create=True, size=64)
        from vllm.utils.network_utils import get_open_zmq_ipc_path
        ipc = get_open_zmq_ipc_path()
        print(before, after, shm.name, os.path.exists("/dev/shm/" + shm.name), named.name, ipc,
              os.path.isdir(os.environ["VLLM_RPC_BASE_PATH"]))
        for s in (shm, named):
            s.close(); s.unlink()
        os.rmdir(os.environ["VLLM_RPC_BASE_PATH"])
    """
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    out = subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after, psm, exists, named, ipc, ipc_dir = out.stdout.split()
    assert before == "//-tp:0-[0-1]-cpushm"
    assert after == "megarl-0123456789ab-tp:0-[0-1]-cpushm"
    assert psm.startswith("megarl-0123456789ab-psm_") and exists == "True" and named == "given-by-caller"
    # vLLM's ZMQ sockets (never unlinked by vLLM) live in the run's directory, removed with its segments
    assert ipc.startswith("ipc:///dev/shm/megarl-0123456789ab-ipc/") and ipc_dir == "True"


AGENT = """
import signal, subprocess, sys, time
rank = '''
import os, signal, sys, time
from megarl import lifetime
r = int(sys.argv[1])
lifetime.start_rank(r)
if r == 0:
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)  # dies mid-run
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a peer stuck where no handler runs
time.sleep(120)
'''
ranks = [subprocess.Popen([sys.executable, "-c", rank, str(r)]) for r in range(2)]
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.exit(max(r.wait() for r in ranks))
"""


def test_supervisor_kills_the_rest_of_a_run_at_once_when_a_rank_dies():
    """A stand-in torchrun agent with two ranks: rank 0 is SIGKILLed, rank 1 ignores SIGTERM (as a TP peer spinning
    in vLLM's shared-memory all-reduce does). The supervisor kills rank 1 and the agent at once, says so in one
    line, and the run's /dev/shm files are gone."""
    said = []
    t0 = time.time()
    before = set(os.listdir(lifetime.SHM_DIR))
    rc = lifetime.supervise([PY, "-c", AGENT], say=said.append)
    elapsed = time.time() - t0
    assert rc != 0 and elapsed < 10, (rc, elapsed, said)
    deaths = [s for s in said if "died without finishing" in s]
    assert len(deaths) == 1 and deaths[0].startswith("[megarl] rank 0 (pid "), said
    assert "killed the 1 other process(es) of this run at once" in deaths[0]  # rank 1 (the agent reports, exits)
    assert not [p for p in psutil.process_iter() if _run_of(p)], "a process of the run is alive"
    assert not [n for n in set(os.listdir(lifetime.SHM_DIR)) - before if n.startswith("megarl-")]


def test_torchruns_log_directory_belongs_to_the_run(capfd):
    """torchrun makes a log directory per run (``/tmp/torchelastic_*`` by default, never removed): under the
    supervisor it is the run's ``megarl-<id>-torchelastic``, removed with the run's other entries."""
    agent = "import os; os.makedirs(os.environ['PET_LOG_DIR'] + '/run_0/attempt_0'); print(os.environ['PET_LOG_DIR'])"
    before = set(os.listdir(lifetime.SHM_DIR))
    assert lifetime.supervise([PY, "-c", agent], say=lambda line: None) == 0
    logs = capfd.readouterr().out.split()[-1]
    assert re.fullmatch(re.escape(lifetime.SHM_DIR) + r"/megarl-[0-9a-f]{12}-torchelastic", logs), logs
    assert not os.path.exists(logs) and not [n for n in set(os.listdir(lifetime.SHM_DIR)) - before if "megarl-" in n]


def _run_of(p):
    try:
        return p.environ().get(lifetime.RUN_ENV) and lifetime.SUPERVISOR_ENV in p.environ() and p.pid != os.getpid()
    except psutil.Error:
        return False


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_signal_reaches_the_ranks_and_spares_the_agent(tmp_path, sig):
    """SIGUSR1 or SIGTERM to the supervisor and to the agent itself (srun, scancel and a preemption deliver it to
    every process of a step): the rank stops gracefully (and finishes cleanly: no death reported), the agent lives on
    to report its exit status (torchrun's would kill its ranks 30 s after a SIGTERM, whatever their save needs)."""
    rank = f"""
import signal, sys, time
from megarl import lifetime
lifetime.start_rank(0)
stop = []
signal.signal({int(sig)}, lambda *a: stop.append(1))
open({str(tmp_path / "ready")!r}, "w").close()
while not stop:
    time.sleep(0.02)
open({str(tmp_path / "stopped")!r}, "w").close()
lifetime.finish_rank()
"""
    agent = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {rank!r}]))"

    def signal_when_ready(signum, frame):
        for child in psutil.Process().children():  # the agent only (it starts with both ignored), not pytest's
            try:  # own helpers (one may be an unreaped zombie: no command line to read)
                if agent in child.cmdline():
                    child.send_signal(sig)
            except psutil.Error:
                continue
        os.kill(os.getpid(), sig)  # the supervisor forwards it to the rank

    said = []
    previous = signal.signal(signal.SIGALRM, signal_when_ready)
    watcher = _child(f"""
        import os, signal, time
        while not os.path.exists({str(tmp_path / "ready")!r}):
            time.sleep(0.02)
        os.kill({os.getpid()}, signal.SIGALRM)
    """)
    try:
        rc = lifetime.supervise([PY, "-c", agent], say=said.append)
    finally:
        signal.signal(signal.SIGALRM, previous)
        watcher.wait()
    assert rc == 0 and (tmp_path / "stopped").exists(), said
    assert any(f"{sig.name} -> the 1 rank(s) of torchrun" in s for s in said) and not any("died" in s for s in said)
    assert signal.getsignal(sig) is signal.SIG_DFL  # the supervisor's handlers are undone


def _timeout_worker():
    """Rank 0 all-reduces on Megatron's TP group while rank 1 is elsewhere: the timeout, as the trainer reports it."""
    import contextlib
    import io

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.run.rank import run_rank as _rank

    init_distributed(ParallelLayout(tp=2, pp=1, dp=1), timeout_s=3)  # Megatron's groups: whole minutes
    tp = dist.new_group([0, 1], timeout=__import__("datetime").timedelta(seconds=3), group_desc="TEST_TP_GROUP")
    if dist.get_rank() == 1:
        time.sleep(6)
        return None
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = _rank(lambda: dist.all_reduce(torch.ones(1), group=tp))
    del ps
    return rc, err.getvalue()


def test_a_collective_timeout_is_one_line_naming_the_call_group_and_caller():
    rc, err = run_on_ranks(_timeout_worker, 2)
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith("megarl: rank 0: all_reduce on TEST_TP_GROUP (ranks [0, 1]) timed out, called from "), err
    assert "tests/test_lifetime.py" in err and "Timed out waiting 3000ms" in err, err


@pytest.mark.parametrize("timeout_s", [10, 299])
def test_collective_timeout_below_engine_startup_is_refused(timeout_s):
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer.collective_timeout_s.*must be >= 300 s"):
        load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_grpo.yaml"),
                    [f"trainer.collective_timeout_s={timeout_s}"])  # fmt: skip


@pytest.mark.after_all
def test_the_suite_left_no_megarl_process_or_shared_memory(request):
    """Last test of the session: `ps` and /dev/shm against the snapshot taken when the session started. Nothing in
    the suite removes segments or kills processes on the product's behalf."""
    start = request.config.stash[leftovers.START]
    deadline = time.time() + 5
    while True:
        now = leftovers.snapshot()
        processes = {pid: cmd for pid, cmd in now["processes"].items() if pid not in start["processes"]}
        if not processes or time.time() > deadline:
            break
        time.sleep(0.2)
    assert processes == {}, processes
    assert sorted(now["shm"] - start["shm"]) == []


def _rendezvous_worker() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dist.destroy_process_group()
    return world


def test_ranks_start_again_on_a_new_port_when_the_rendezvous_port_is_taken(monkeypatch):
    """The port is free when chosen and bound by rank 0 seconds later; another process may take it in between (a
    suite went red on EADDRINUSE). The ranks are started again on a new port."""
    import socket

    from megarl.parallel import spawn

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken, free, chosen = busy.getsockname()[1], spawn._free_port, []
        monkeypatch.setattr(spawn, "_free_port", lambda: chosen.append(taken if not chosen else free()) or chosen[-1])
        assert run_on_ranks(_rendezvous_worker, 2) == 2
        assert chosen[0] == taken and len(chosen) == 2
