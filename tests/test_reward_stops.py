"""A broken or hanging user reward through the real `megarl train` (one rank, HF rollout: the engine is not the point):
a reward that fails on every sample stops the run at step 1 with a non-zero exit and its first error in one block;
SIGTERM while the reward hangs ends the run (exit 75) within trainer.stop_grace_s, and the next run works. No reward
worker outlives a run."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

from megarl.run.resume import EXIT_PREEMPTED
from tests.leftovers import alive_after

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 2


def _cmd(model, out, reward, *extra):
    return [sys.executable, "-m", "megarl.cli", "train", "configs/quickstart.yaml", f"model.path={model}",
            f"trainer.output_dir={out}", "actor.parallel.tp=1", "rollout.backend=hf", "trainer.total_steps=3",
            "trainer.val_every=0", "logging.wandb.mode=disabled", "logging.progress_bar=false",
            "data.train_batch_size=4", "rollout.sampling.n=4", "actor.global_batch_size=16",
            "rollout.sampling.max_new_tokens=6", f"reward.function=tests/misbehaving_rewards.py:{reward}",
            *extra]  # fmt: skip


def _is_worker(proc) -> bool:
    return "megarl.rewards.worker" in proc.cmdline()


def _start(cmd, log, **env):
    tag = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGARL_TEST_RUN": tag, **env}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, tag


def _finish(proc, tag, log):
    """Exit status, output, and the reward workers alive 2 s after the run ended (they are killed, after looking)."""
    try:
        rc = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    workers = alive_after(tag, 2, select=_is_worker)
    left = [f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in workers]
    for p in workers:
        p.kill()
    return rc, open(log.name).read(), left


def test_a_reward_that_fails_on_every_sample_stops_the_run_at_step_1(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    with open(tmp_path / "log", "w") as log:
        proc, tag = _start(_cmd(tiny_llama_dir, out, "always_raises"), log)
        rc, text, left = _finish(proc, tag, log)
    assert rc == 1, text[-3000:]
    block = text[text.index("megarl: the reward function failed") :]
    assert block.startswith(
        "megarl: the reward function failed on 16 of 16 samples in step 1 (reward.stop_on_error_fraction=1); "
        "stopping the run."
    ), text[-3000:]
    first = "The first failure: the sample of prompt 'repeat 1:' raised:\nTraceback (most recent call last):\n  "
    assert first in block
    assert block.rstrip().endswith("KeyError: \"no judge for 'repeat 1:': the reward is broken\""), block
    assert text.count("Traceback") == 1 and "misbehaving_rewards.py" in block  # only the user's, once
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
    assert left == []


def test_sigterm_while_the_reward_hangs_ends_the_run_within_the_grace_and_the_next_run_starts_over(
    tiny_llama_dir, tmp_path
):
    """The reward hangs far beyond the grace (reward.timeout_s=600): SIGTERM cancels the reward workers' calls
    instead of waiting for them, drops step 1 (nothing completed: nothing to save) and exits 75 within
    trainer.stop_grace_s; the same command then starts over and completes."""
    out, marker = tmp_path / "out", tmp_path / "marker"
    cmd = _cmd(tiny_llama_dir, out, "hang", "reward.timeout_s=600", "reward.step_timeout_s=600",
               "trainer.collective_timeout_s=900")  # fmt: skip
    with open(tmp_path / "log", "w") as log:
        proc, tag = _start(cmd, log, MEGARL_TEST_BAD_DIGITS="7", MEGARL_TEST_MARKER=str(marker))  # 'say 7:', step 1
        deadline = time.monotonic() + 240
        while not (marker.exists() and "hang" in marker.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, open(log.name).read()[-3000:]
            time.sleep(0.05)
        assert marker.exists(), open(log.name).read()[-3000:]
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        rc, text, left = _finish(proc, tag, log)
        seconds = time.monotonic() - signalled
    assert rc == EXIT_PREEMPTED, text[-3000:]
    assert seconds < 25, seconds  # trainer.stop_grace_s (the default); nothing to save
    assert "stopped by SIGTERM during step 1's rollout: no step completed, nothing to save" in text, text[-3000:]
    assert left == []
    with open(tmp_path / "log2", "w") as log:
        proc, tag = _start(cmd, log, MEGARL_TEST_BAD_DIGITS="@")  # no prompt has '@': nothing hangs
        rc, text, left = _finish(proc, tag, log)
    assert rc == 0, text[-3000:]
    assert "held a run that never completed a step" in text and "starting over" in text
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert left == []


def test_a_reward_hanging_on_every_second_call_is_bounded_by_the_step_budget(tiny_llama_dir, tmp_path):
    """reward.timeout_s=2, reward.step_timeout_s=4: every step's scoring ends within the step budget (the samples
    still unscored then score 0 as timeouts) and the 3-step run completes."""
    out = tmp_path / "out"
    cmd = _cmd(tiny_llama_dir, out, "hang_every_second_call", "reward.timeout_s=2", "reward.step_timeout_s=4",
               "reward.stop_on_error_fraction=null")  # fmt: skip
    with open(tmp_path / "log", "w") as log:
        proc, tag = _start(cmd, log)
        rc, text, left = _finish(proc, tag, log)
    assert rc == 0, text[-3000:]
    assert "2 s per call, 4 s per step (reward.step_timeout_s)" in text
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r["reward/timeouts"] for r in rows) > 0
    assert max(r["timing/reward"] for r in rows) < 4 + 2, [r["timing/reward"] for r in rows]
    assert left == []
