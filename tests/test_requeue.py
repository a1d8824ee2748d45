"""What a requeued SLURM job runs: the same `megarl train` command with trainer.resume=auto. A run SIGKILLed before it
completed a step starts over (its files set aside, the SLURM log folder left alone) and equals an uninterrupted run;
the same command on a complete run exits 0. One rank, HF rollout, the built-in reward: the resume logic is the point."""

import contextlib
import json
import os
import signal
import subprocess
import sys

from megarl import faults

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_ALGORITHMIC = ("timing/", "perf/", "memory/", "sync/seconds", "rollout/tokens_per_s", "pool/")


def _cmd(model, out):
    return [sys.executable, "-m", "megarl.cli", "train", "configs/quickstart.yaml", f"model.path={model}",
            f"trainer.output_dir={out}", "actor.parallel.tp=1", "rollout.backend=hf", "trainer.total_steps=2",
            "trainer.val_every=0", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "data.train_batch_size=4", "rollout.sampling.n=4", "actor.global_batch_size=16",
            "rollout.sampling.max_new_tokens=6"]  # fmt: skip


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def _run(cmd) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)


def _algorithmic(out) -> list[dict]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith(NOT_ALGORITHMIC)} for r in rows]


def test_a_run_killed_before_its_first_step_starts_over_and_a_complete_run_exits_0(tiny_llama_dir, tmp_path):
    def cmd(out):  # a generation of ~0.27 s (a step ~0.38 s; 30 and 70 ms at 6 tokens): the kill 50 ms into the
        # first lands inside it
        return _cmd(tiny_llama_dir, out) + ["rollout.max_model_len=160", "actor.seq_length=160",
                                            "rollout.sampling.max_new_tokens=128"]  # fmt: skip

    reference = _run(cmd(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]

    out = tmp_path / "run"
    (out / "slurm").mkdir(parents=True)
    (out / "slurm" / "job.out").write_text("the live job's log\n")
    # SIGKILLed in the middle of step 1's generation, as a preemption without grace would (a kill timed from outside
    # raced the step: a CI run saw step 1 complete between the config file appearing and the kill)
    proc = subprocess.Popen(cmd(out), cwd=REPO, env={**_env(), faults.ENV: "generate@1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    assert proc.wait(timeout=300) == -signal.SIGKILL
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything it started goes with it
    assert (out / "config.yaml").exists()  # the run had started
    if (out / "metrics.jsonl").exists():
        assert not _algorithmic(out)  # killed before a step completed
    assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints")

    again = _run(cmd(out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "held a run that never completed a step: its files moved to" in again.stdout
    assert _algorithmic(out) == _algorithmic(tmp_path / "reference")
    assert (out / "slurm" / "job.out").read_text() == "the live job's log\n"
    assert any(name.startswith("set-aside-") for name in os.listdir(out))

    complete = _run(cmd(out))
    assert complete.returncode == 0, complete.stderr[-3000:]
    assert "the run is complete, nothing to do" in complete.stdout


def test_a_signal_during_start_up_exits_75_with_nothing_saved(tiny_llama_dir, tmp_path):
    """SIGUSR1 (SLURM's warning before a preemption) while the rank is still starting: the handlers are installed
    before anything is built, so the run ends as a stop (exit 75, one line), not a death, and saves nothing."""
    out = tmp_path / "run"
    env = {**_env(), "MEGARL_FAULT": "sigusr1@0"}
    stopped = subprocess.run(_cmd(tiny_llama_dir, out), cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert stopped.returncode == 75, (stopped.stdout[-3000:], stopped.stderr[-3000:])
    assert "stopped by SIGUSR1 during start-up; nothing to save" in stopped.stdout, stopped.stdout[-3000:]
    assert not (out / "checkpoints").exists() or not [p for p in os.listdir(out / "checkpoints") if "iter_" in p]
