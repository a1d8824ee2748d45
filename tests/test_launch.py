"""Multi-node launchers. `megarl launch torchrun`: the command of each node and the refusals (pure). `megarl launch
slurm`: the sbatch script's content (pure), then the script itself on a real SLURM cluster brought up on this machine
(slurmctld + 2 slurmd, tests/slurm/bringup.sh): 2 nodes x 1 CPU rank train GRPO on a tiny model, get SIGUSR1 from
`scancel --signal=USR1 --batch` (the time limit's warning) or SIGTERM to every process of its steps at once from
`scancel --signal=TERM` mid-run, save, write STOPPED, requeue themselves, resume and finish with the metrics of the
same run never stopped."""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time

import pytest

from megarl.cli import main as megarl_main
from megarl.config import load_config
from megarl.config.topology import LaunchError
from megarl.launch import torchrun as torchrun_launcher
from megarl.launch.slurm import NetworkEnv, SlurmOptions, render
from megarl.launch.torchrun import TorchrunOptions, torchrun_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(REPO, "configs", "tiny_grpo.yaml")
TP2_DP2 = ["actor.parallel.tp=2", "actor.parallel.dp=2"]


def _launch(capsys, *argv):
    rc = megarl_main(["launch", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# --- torchrun: one command per node -------------------------------------------------------------------------------
def test_torchrun_command_for_node_1_of_2():
    opts = TorchrunOptions(recipe=RECIPE, overrides=TP2_DP2, nnodes=2, node_rank=1, master_addr="node0",
                           master_port=29400)  # fmt: skip
    cmd = torchrun_command(opts, load_config(RECIPE, TP2_DP2), python="/venv/bin/python")
    assert cmd == [
        "/venv/bin/python", "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=1", "--nproc-per-node=2",
        "--master-addr=node0", "--master-port=29400", "-m", "megarl.cli", "train", RECIPE, *TP2_DP2,
    ]  # fmt: skip


def test_torchrun_dry_run_prints_the_command(capsys, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(REPO)  # a relative recipe reaches the ranks as an absolute path
    model = f"model.path={tiny_llama_dir}"
    argv = ["configs/tiny_grpo.yaml", "--nnodes", "2", "--node-rank", "0", "actor.parallel.tp=2", "--master-addr",
            "10.0.0.1", "actor.parallel.dp=2", model, "--dry-run"]  # fmt: skip
    rc, out, err = _launch(capsys, "torchrun", *argv)
    assert rc == 0, err
    argv = shlex.split(out)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in argv and "--node-rank=0" in argv and "--master-addr=10.0.0.1" in argv
    assert argv[-5:] == ["train", RECIPE, *TP2_DP2, model]  # overrides after options reach the ranks


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--nnodes", "2", "--nproc-per-node", "4", *TP2_DP2],
            "--nnodes 2 x --nproc-per-node 4 = 8 ranks, but the recipe's actor.parallel tp=2 x pp=1 x dp=2 needs 4",
        ),
        (["--nnodes", "3", *TP2_DP2], "--nnodes 3 does not divide the 4 ranks"),
        (
            ["--nnodes", "2", "--nproc-per-node", "2", "actor.parallel.tp=4", "actor.parallel.dp=1"],
            "actor.parallel.tp=4 with --nproc-per-node 2: the TP group of ranks [0, 1, 2, 3] would span nodes [0, 1]",
        ),
        (
            ["--nnodes", "4", "actor.parallel.tp=2", "actor.parallel.dp=2"],
            "actor.parallel.tp=2 with --nproc-per-node 1: the TP group of ranks [0, 1] would span nodes [0, 1]",
        ),
        (["--nnodes", "2", "--node-rank", "2", *TP2_DP2], "--node-rank 2 is outside 0..1 (--nnodes 2)"),
        (["--nnodes", "2", "--node-rank", "-1", *TP2_DP2], "--node-rank -1 is outside 0..1"),
        (["--nnodes", "0", *TP2_DP2], "--nnodes must be >= 1, got 0"),
        (["--nnodes", "2", "--master-port", "70000", *TP2_DP2], "--master-port 70000 is not a TCP port"),
        (["--nnodes", "2", "actor.paralel.tp=2"], "config error: actor.paralel: unknown key"),
    ],
)
def test_torchrun_refuses_before_starting_anything(capsys, args, message):
    if "--node-rank" not in args:
        args = [*args, "--node-rank", "0"]
    rc, out, err = _launch(capsys, "torchrun", RECIPE, "--master-addr", "node0", *args)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("megarl: launch torchrun: "), err
    assert message in err, err


def test_torchrun_launch_exits_75_after_a_stop(capsys, monkeypatch, tmp_path, tiny_llama_dir):
    """The ranks stopped after a save (STOPPED in trainer.output_dir, torchrun exit 0): status 75, requeue me."""
    ran = []

    def ranks_stop(cmd, **kwargs):
        ran.append(cmd)
        (tmp_path / "STOPPED").write_text("step 3: stopped by SIGUSR1\n")
        return 0

    monkeypatch.setattr(torchrun_launcher.lifetime, "supervise", ranks_stop)
    args = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "node0", *TP2_DP2, f"model.path={tiny_llama_dir}",
            f"trainer.output_dir={tmp_path}"]  # fmt: skip
    rc, out, err = _launch(capsys, "torchrun", RECIPE, *args)
    assert rc == 75 and len(ran) == 1 and ran[0][-1] == f"trainer.output_dir={tmp_path}", err
    assert out.startswith("[megarl] node 1/2: ") and "--node-rank=1" in out


# --- slurm: the sbatch script ------------------------------------------------------------------------------------
def _script(**kw) -> str:
    opts = SlurmOptions(recipe=RECIPE, overrides=kw.pop("overrides", TP2_DP2), **kw)
    return render(opts, load_config(RECIPE, opts.overrides), python="/venv/bin/python")


def test_sbatch_script_content(tmp_path):
    env_file = tmp_path / "cluster.env"
    env_file.write_text("# cluster A\nNCCL_IB_HCA=mlx5_0,mlx5_1\n\nexport NCCL_SOCKET_IFNAME='ib0'  # the IB port\n"
                        "NCCL_IB_GID_INDEX=3 # RoCE v2\nNCCL_DEBUG=INFO\n"
                        'NCCL_TOPO_FILE="/etc/my topo.xml"\n')  # fmt: skip
    script = _script(
        nodes=2, gpus_per_node=2, partition="gpu", account="rl", time="04:00:00", signal_secs=120,
        log_dir=str(tmp_path / "logs"), env_file=str(env_file), job_name="grpo-8b", rdzv_port=29411,
        network=NetworkEnv(nccl_ib_hca="mlx5_4", nccl_debug="WARN",
                           extra=["NCCL_IB_TIMEOUT=22", "WANDB_API_KEY=s3cr3t"]),
    )  # fmt: skip
    lines = script.splitlines()
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    for want in ["--job-name=grpo-8b", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=2", "--partition=gpu",
                 "--account=rl", "--time=04:00:00", "--signal=B:USR1@120", "--requeue", f"--chdir={os.getcwd()}",
                 f"--output={tmp_path}/logs/%x-%j.log"]:  # fmt: skip
        assert f"#SBATCH {want}" in sbatch, want
    exports = dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))
    assert exports == {
        "NCCL_IB_HCA": "mlx5_4",  # the flag over the file
        "NCCL_SOCKET_IFNAME": "ib0",  # the env file read as a shell reads it: quotes, comments after a value
        "GLOO_SOCKET_IFNAME": "ib0",  # megarl's gloo groups bind to the same interface
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_DEBUG": "WARN",  # the flag over the file over the default
        "NCCL_TOPO_FILE": "'/etc/my topo.xml'",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    for key in ("NCCL_IB_TIMEOUT", "WANDB_API_KEY"):  # --env: named, never written (sbatch's environment has them)
        assert any(line.startswith(f': "${{{key}?') and line.endswith(f"; export {key}") for line in lines), key
    assert "s3cr3t" not in script and "=22" not in script
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in lines
    srun = script[script.index("srun ") : script.index("&\n")].replace("\\\n", " ")
    assert f"--output={tmp_path}/logs/%x-%j-node%n.log" in srun  # one log per node
    assert "/venv/bin/python -m megarl.launch.node /venv/bin/python -m torch.distributed.run --nnodes=2 " in srun
    assert '--rdzv-backend=c10d --rdzv-endpoint="$head_node:29411" --rdzv-id="$SLURM_JOB_ID"' in srun
    assert srun.split()[-5:] == ["train", RECIPE, *TP2_DP2, "trainer.resume=auto"]
    assert "trap 'stop_ranks USR1' USR1" in lines and "trap 'stop_ranks TERM' TERM" in lines
    assert 'kill -USR1 "$srun_pid"' in script
    stopped = os.path.join(os.path.abspath(load_config(RECIPE).trainer.output_dir), "STOPPED")
    assert f"stopped={stopped}" in lines and '  scontrol requeue "$SLURM_JOB_ID"' in lines
    check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_gloo_socket_ifname_follows_nccl_flag_and_env_file(tmp_path):
    def exports(**kw):
        lines = _script(nodes=2, gpus_per_node=2, **kw).splitlines()
        return dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))

    flag = exports(network=NetworkEnv(nccl_socket_ifname="=eth1"))
    assert flag["NCCL_SOCKET_IFNAME"] == "=eth1" and flag["GLOO_SOCKET_IFNAME"] == "eth1"
    shipped = exports(env_file=os.path.join(REPO, "launch/clusters/example.env"))
    assert shipped["GLOO_SOCKET_IFNAME"] == shipped["NCCL_SOCKET_IFNAME"] == "ib0"
    own = tmp_path / "own.env"
    own.write_text("NCCL_SOCKET_IFNAME=^lo,docker0\nGLOO_SOCKET_IFNAME=bond0\n")
    assert exports(env_file=str(own))["GLOO_SOCKET_IFNAME"] == "bond0"  # set on its own: kept
    with pytest.raises(LaunchError, match="excludes interfaces, which gloo cannot do"):
        exports(network=NetworkEnv(nccl_socket_ifname="^lo,docker0"))
    assert "GLOO_SOCKET_IFNAME" not in exports()  # nothing given: neither is set


def test_sbatch_script_cpu_nodes_request_no_gpus():
    script = _script(nodes=2, gpus_per_node=1, cpu=True, cpus_per_node=4,
                     overrides=["actor.parallel.tp=1", "actor.parallel.dp=2"])  # fmt: skip
    assert "--gpus-per-node" not in script and "#SBATCH --exclusive" not in script
    assert "#SBATCH --cpus-per-task=4" in script and "srun --kill-on-bad-exit=1 --cpus-per-task=4 " in script
    assert "# NCCL_IB_HCA: not set" in script and "export NCCL_IB_HCA" not in script
    whole_nodes = _script(nodes=1, gpus_per_node=4)
    assert "#SBATCH --exclusive" in whole_nodes and '--cpus-per-task="$SLURM_CPUS_ON_NODE"' in whole_nodes


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "2", "--gpus-per-node", "8", *TP2_DP2], "--nodes 2 x --gpus-per-node 8 = 16 ranks"),
        (["--nodes", "4", "--gpus-per-node", "1", *TP2_DP2], "the TP group of ranks [0, 1] would span nodes [0, 1]"),
        (
            ["--nodes", "2", "--gpus-per-node", "2", *TP2_DP2, "trainer.resume=never"],
            "trainer.resume=never: a requeued job must continue its own checkpoints",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "2", *TP2_DP2, "--env", "NCCL DEBUG=INFO"],
            "--env: expected KEY=VALUE, got 'NCCL DEBUG=INFO'",
        ),
        (
            ["--nodes", "2", "--gpus-per-node", "2", *TP2_DP2, "--env-file", "/nonexistent.env"],
            "--env-file /nonexistent.env: No such file or directory",
        ),
        (["--nodes", "2", "--gpus-per-node", "0", *TP2_DP2], "--gpus-per-node must be >= 1, got 0"),
    ],
)
def test_slurm_refuses_bad_input(capsys, tmp_path, args, message):
    rc, out, err = _launch(capsys, "slurm", RECIPE, *args, "--output", str(tmp_path))
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("megarl: launch slurm: "), err
    assert message in err, err


def test_env_file_line_errors_name_the_line(tmp_path):
    env_file = tmp_path / "bad.env"
    env_file.write_text("NCCL_DEBUG=WARN\nnot an assignment\n")
    with pytest.raises(LaunchError, match=rf"--env-file {env_file}:2: expected KEY=VALUE"):
        _script(nodes=2, gpus_per_node=2, env_file=str(env_file))


# --- slurm: the generated script on a real cluster ---------------------------------------------------------------
SLURM_DIR = os.environ.get("SLURM_TEST_DIR", "/tmp/megarl-slurm")
STEPS = 30  # ~0.15 s each here: the stop request lands mid-run
SECRET = "hunter2-not-on-disk"


def _slurm_env() -> dict:
    env = {**os.environ, "SLURM_CONF": os.path.join(SLURM_DIR, "slurm.conf"), "SLURM_TEST_DIR": SLURM_DIR,
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    for key in ("WORLD_SIZE", "MEGARL_FAULT"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="session")
def slurm_cluster():
    """slurmctld + 2 slurmd on this machine (installs slurm-wlm and munge if missing); torn down at the end if this
    fixture started it."""
    env = _slurm_env()
    was_up = _controller_running()
    up = subprocess.run(["bash", os.path.join(REPO, "tests", "slurm", "bringup.sh")], env=env, capture_output=True,
                        text=True, timeout=300)  # fmt: skip
    if up.returncode:
        pytest.fail(
            "could not bring up the local SLURM cluster for the launcher test (needs root and the Debian packages "
            f"slurm-wlm + munge: `apt-get install -y slurm-wlm munge`, or `make install` as root):\n"
            f"{up.stdout}{up.stderr}"
        )
    yield env
    if not was_up:
        subprocess.run(["bash", os.path.join(REPO, "tests", "slurm", "teardown.sh")], env=env, capture_output=True)


def _controller_running() -> bool:
    """Whether bringup.sh's slurmctld already runs (by its pid file, as bringup.sh checks)."""
    try:
        with open(os.path.join(SLURM_DIR, "slurmctld.pid")) as f:
            os.kill(int(f.read()), 0)
        return True
    except (OSError, ValueError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(job_id: str, env: dict) -> dict:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _logs(log_dir) -> str:
    return "".join(f"==> {p.name}\n{p.read_text()}" for p in sorted(log_dir.glob("*.log")))


def _nodes_idle(env: dict) -> bool:
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True).stdout.split()
    return len(states) == 2 and all(s == "idle" for s in states)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _until(what: str, check, timeout_s: float, log_dir, job_id: str, env: dict):
    """Poll ``check`` until it returns something true; fail with the job's state and logs on a timeout or when the
    job ended first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        ended = _job(job_id, env).get("JobState") in ENDED  # looked at first: a job that ends between the two looks
        found = check()  # is seen by the check (CI once failed "no end" on a job already COMPLETED)
        if found:
            return found
        if ended:
            break
        time.sleep(0.2)
    pytest.fail(f"SLURM job {job_id}: no {what} after {timeout_s:.0f} s ({_job(job_id, env)})\n{_logs(log_dir)}")


def _run_overrides(tiny_llama_dir, out_dir) -> list[str]:
    return [f"model.path={tiny_llama_dir}", f"trainer.output_dir={out_dir}", "actor.parallel.tp=1",
            "actor.parallel.dp=2", "rollout.backend=hf", f"trainer.total_steps={STEPS}", "trainer.val_every=0",
            "logging.wandb.mode=disabled", "logging.progress_bar=false", "data.train_batch_size=2",
            "actor.global_batch_size=16", "rollout.sampling.max_new_tokens=4"]  # fmt: skip


STOPS = {"USR1": ["--signal=USR1", "--batch"], "TERM": ["--signal=TERM"]}
"""How each job is stopped: SIGUSR1 to the batch shell (as ``--signal=B:USR1@lead`` before the time limit), or
SIGTERM to every process of the job's steps at once (the node launchers, torchrun's agents and the ranks on every
node; not the batch shell and srun, whose SIGTERM would make srun SIGKILL the step: docs/launch.md)."""


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama_dir, tmp_path_factory):
    """The same run on this machine (2 local ranks), never stopped: its metrics."""
    out_dir = tmp_path_factory.mktemp("slurm-reference") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGARL_FAULT", None)
    cmd = [sys.executable, "-m", "megarl.cli", "train", RECIPE, *_run_overrides(tiny_llama_dir, out_dir)]
    run = subprocess.run(cmd,
                         env=env, capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=list(STOPS))
def preempted_job(request, slurm_cluster, tiny_llama_dir, tmp_path_factory):
    """Submit the generated script (2 nodes x 1 CPU rank), stop it (``STOPS``) once step 1 is logged, wait for the
    requeue, start the requeued job at once (SLURM would hold it a minute) and wait for its end."""
    env, t0, stop = slurm_cluster, time.time(), request.param
    out_dir = tmp_path_factory.mktemp(f"slurm-{stop}") / "run"
    log_dir = out_dir / "slurm"
    submit = subprocess.run(
        [sys.executable, "-m", "megarl.cli", "launch", "slurm", RECIPE, "--nodes", "2", "--gpus-per-node", "1",
         "--cpu", "--rdzv-port", str(_free_port()), "--submit", *_run_overrides(tiny_llama_dir, out_dir),
         "--env", f"MEGARL_TEST_SECRET={SECRET}"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert submit.returncode == 0 and submit.stdout.strip().isdigit(), submit.stderr
    job_id = submit.stdout.strip()
    try:
        metrics = out_dir / "metrics.jsonl"
        _until("step 1", lambda: metrics.exists() and metrics.read_text().strip(), 150, log_dir, job_id, env)
        subprocess.run(["scancel", *STOPS[stop], job_id], env=env, check=True)
        requeued = lambda: (job := _job(job_id, env)).get("Restarts") == "1" and job.get("JobState") != "COMPLETING"  # noqa: E731
        _until("requeue", requeued, 90, log_dir, job_id, env)  # Restarts counts up while the job is still COMPLETING
        stopped = out_dir / "STOPPED"
        at_requeue = {
            "stopped": stopped.read_text() if stopped.exists() else None,
            "checkpoints": sorted(p.name for p in (out_dir / "checkpoints").glob("iter_*")),
            "metrics_steps": [json.loads(line)["step"] for line in metrics.read_text().splitlines()],
            "job": _job(job_id, env),
        }
        _until("idle nodes", lambda: _nodes_idle(env), 60, log_dir, job_id, env)
        # slurmd refuses a credential issued in the second it revoked the job's last one ("Job credential revoked"):
        # SLURM holds requeued jobs for that reason; two seconds are enough here (the update also starts it at once)
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, check=True)
        _until("end", lambda: _job(job_id, env).get("JobState") in ENDED, 150, log_dir, job_id, env)
        print(f"[test_launch] SLURM SIG{stop} + requeue + resume: {time.time() - t0:.1f} s")
        return {"out": out_dir, "logs": log_dir, "job_id": job_id, "at_requeue": at_requeue, "end": _job(job_id, env),
                "stop": stop}  # fmt: skip
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)


def test_slurm_job_stops_on_usr1_or_term_saves_and_requeues(preempted_job):
    """The ranks stop and save whichever signal reaches them first (SIGTERM directly, or the batch shell's SIGUSR1
    through srun); torchrun's agent, which would kill them 30 s after a SIGTERM, ignores it."""
    at, stop = preempted_job["at_requeue"], preempted_job["stop"]
    logs = _logs(preempted_job["logs"])
    got = "SIGUSR1" if stop == "USR1" else "(SIGTERM|SIGUSR1)"
    assert at["stopped"] and re.match(rf"step \d+: stopped by {got} ", at["stopped"]), logs
    signal_name = at["stopped"].split("stopped by ")[1].split()[0]
    stop_step = int(at["stopped"].split()[1].rstrip(":"))
    assert 1 <= stop_step < STEPS and at["metrics_steps"] == list(range(1, stop_step + 1))
    assert at["checkpoints"] == [f"iter_{stop_step:07d}"]
    assert (preempted_job["out"] / "checkpoints" / f"iter_{stop_step:07d}" / "manifest.json").exists()
    assert at["job"]["JobState"] == "PENDING" and at["job"]["Restarts"] == "1"
    if stop == "USR1":  # to the batch shell, which passes it on through srun
        assert "SIGUSR1: stopping the ranks (a rollout in progress is cut, an update finishes), then a save" in logs
    else:  # to every process of the step: each node's launcher passes it on to its rank, the agent ignores it
        assert all(re.search(rf"\[megarl\] node {n} \(.*\): SIGTERM -> the 1 rank", logs) for n in (0, 1)), logs
    assert f"requeueing job {preempted_job['job_id']} to resume" in logs
    after = f"stopped by {signal_name} after step {stop_step}; saved"  # it landed in an update
    cut = (rf"stopped by {signal_name} during step {stop_step + 1}'s rollout: it is dropped; (saved|its checkpoint "
           "holds) step")  # fmt: skip
    assert after in logs or re.search(cut, logs), logs
    assert "SignalException" not in logs and "closing signal" not in logs  # the agent did not touch its ranks


def test_requeued_slurm_job_resumes_and_finishes(preempted_job):
    end, out = preempted_job["end"], preempted_job["out"]
    logs = _logs(preempted_job["logs"])
    assert end["JobState"] == "COMPLETED" and end["ExitCode"] == "0:0", logs
    stop_step = int(preempted_job["at_requeue"]["stopped"].split()[1].rstrip(":"))
    assert f"resuming from {out}/checkpoints/iter_{stop_step:07d} (step {stop_step};" in logs
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # continued, never duplicated
    assert not (out / "STOPPED").exists()
    assert "(restart 1) on n[1-2]" in logs and "ranks exited with status 0" in logs


def test_the_resumed_slurm_job_equals_the_run_never_stopped(preempted_job, uninterrupted):
    """Every algorithmic metric of every step, equal floats (the stop's step is regenerated or continued exactly)."""
    rows = [json.loads(line) for line in (preempted_job["out"] / "metrics.jsonl").read_text().splitlines()]
    timing = ("timing/", "perf/", "memory/", "sync/seconds", "rollout/tokens_per_s", "pool/")
    algorithmic = lambda row: {k: v for k, v in row.items() if not k.startswith(timing)}  # noqa: E731
    assert len(rows) == len(uninterrupted) == STEPS
    for mine, ref in zip(rows, uninterrupted):
        assert algorithmic(mine) == algorithmic(ref), f"step {ref['step']}"


def test_slurm_job_writes_one_log_per_node(preempted_job):
    job_id, name = preempted_job["job_id"], "megarl-tiny_grpo"
    logs = {p.name: p.read_text() for p in preempted_job["logs"].glob("*.log")}
    assert set(logs) == {f"{name}-{job_id}.log", f"{name}-{job_id}-node0.log", f"{name}-{job_id}-node1.log"}
    for node in (0, 1):  # each node's wrapper passed the stop on to its own rank
        assert f"[megarl] node {node} (" in logs[f"{name}-{job_id}-node{node}.log"]
    ranks_0 = [n for n, text in logs.items() if re.search(r"\[megarl\] \d+ steps in", text)]
    assert len(ranks_0) == 1 and ranks_0[0].endswith(("-node0.log", "-node1.log"))  # rank 0's lines: one node's log
    script = preempted_job["logs"] / f"{name}.sbatch"
    assert script.read_text().startswith("#!/bin/bash\n# megarl on SLURM")
    # --env: not on disk, the script owner-only; the job saw it (the script's `${MEGARL_TEST_SECRET?}` check passed)
    assert SECRET not in script.read_text() and ': "${MEGARL_TEST_SECRET?' in script.read_text()
    assert script.stat().st_mode & 0o777 == 0o600


def test_pools_size_the_launch_and_keep_each_pools_tp_groups_in_a_node(tiny_llama_dir):
    from megarl.config import load_config
    from megarl.config.topology import check_nodes

    pools = ["placement.pools.train.ranks=0-1", "placement.pools.train.roles=[actor]",
             "placement.pools.rollout.ranks=2-3", "placement.pools.rollout.roles=[rollout]"]  # fmt: skip
    cfg = load_config("configs/tiny_grpo.yaml", [f"model.path={tiny_llama_dir}", *pools])
    check_nodes(cfg, 2, 2, "--nnodes", "--nproc-per-node")  # train pool on node 0, rollout pool on node 1
    check_nodes(cfg, 1, 4, "--nnodes", "--nproc-per-node")
    with pytest.raises(LaunchError, match=r"= 2 ranks, but placement.pools cover 4"):
        check_nodes(cfg, 1, 2, "--nnodes", "--nproc-per-node")
    with pytest.raises(LaunchError, match=r"placement.pools.train: the TP group of ranks \[0, 1\] would span"):
        check_nodes(cfg, 4, 1, "--nnodes", "--nproc-per-node")


def test_slurm_signal_lead_comes_from_the_plan(capsys, tmp_path):
    """No --signal-secs: the lead is max(300, the planned update + sync + trainer.stop_grace_s + save + the
    manifest's hashing pass over what was written) on these nodes, printed with its derivation; a slow checkpoint
    filesystem lengthens it. 70B PPO on 8 x 8: 241 GB per node written at 2 GB/s (120.5 s) and read back for the
    hashes at 2 GB/s (8 ranks x 1 GB/s of SHA-256 would be faster): 90.4 + 0.63 + 25 + 120.5 + 120.5 -> 357 s."""
    recipe = "configs/llama2_70b_ppo_tp4pp8dp2.yaml"
    rc, out, err = _launch(capsys, "slurm", recipe, "--nodes", "8", "--gpus-per-node", "8", "--output", str(tmp_path))
    assert rc == 0, err
    line = next(line for line in err.splitlines() if "SIGUSR1 lead" in line)
    assert "357 s = max(300, an update in progress 90.4 + sync 0.63" in line, line
    assert "trainer.stop_grace_s 25 + save 120.5 + manifest hashing 120.5 s" in line, line
    assert "#SBATCH --signal=B:USR1@357" in out
    rc, out, err = _launch(capsys, "slurm", recipe, "--nodes", "8", "--gpus-per-node", "8", "--fs-gb-s", "0.5",
                           "--output", str(tmp_path))  # fmt: skip
    line = next(line for line in err.splitlines() if "SIGUSR1 lead" in line)
    lead = int(line.split("(--signal-secs): ")[1].split(" s = ")[0])
    assert lead > 300 and f"#SBATCH --signal=B:USR1@{lead}" in out, line
    rc, out, _ = _launch(capsys, "slurm", recipe, "--nodes", "8", "--gpus-per-node", "8", "--signal-secs", "900",
                         "--output", str(tmp_path))  # fmt: skip
    assert "#SBATCH --signal=B:USR1@900" in out
