"""Exact resume through the real `megarl train` command: a run killed at named points (SIGKILL mid-generation,
SIGKILL mid-save, SIGTERM mid-step) and once at a random moment from outside, resumed with trainer.resume=auto each
time, ends with the same metrics (every algorithmic one, equal floats) and the same weights and optimizer states
(equal tensors) as the run that was never stopped. GRPO at TP=2 and PPO (critic) at TP=1 x DP=2 with the
distributed optimizer.
"""

import json
import os
import random
import subprocess
import sys
import tempfile
import uuid

import psutil
import pytest
import torch

from megarl.trainer.resume import EXIT_PREEMPTED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
COMMON = [f"trainer.total_steps={STEPS}", "trainer.save_every=2", "trainer.val_every=0", "logging.wandb.mode=disabled",
          "logging.progress_bar=false", "data.train_batch_size=4", "actor.global_batch_size=32",
          "rollout.sampling.max_new_tokens=6"]  # fmt: skip
LAYOUTS = {
    "grpo_tp2": ("configs/tiny_grpo.yaml", []),
    "ppo_dp2_distopt": (
        "configs/tiny_ppo.yaml",
        ["actor.parallel.tp=1", "actor.parallel.dp=2", "actor.optim.use_distributed_optimizer=true",
         "critic.optim.use_distributed_optimizer=true", "data.train_batch_size=8", "actor.global_batch_size=16"],
    ),
}  # fmt: skip
NOT_ALGORITHMIC = ("timing/", "perf/", "memory/", "sync/seconds", "rollout/tokens_per_s")


def _cmd(recipe, hf_dir, out_dir, extra):
    return [sys.executable, "-m", "megarl.cli", "train", recipe, f"model.path={hf_dir}",
            f"trainer.output_dir={out_dir}", *COMMON, *extra]  # fmt: skip


def _env(fault=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("WORLD_SIZE", None)
    env.pop("MEGARL_FAULT", None)
    if fault:
        env["MEGARL_FAULT"] = fault
    return env


def _kill_run(tag):
    """SIGKILL every process of one run: launcher, torchrun, ranks (each in a session of its own) and the helper
    processes megatron's checkpoint writer starts (they outlive a killed rank)."""
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("MEGARL_TEST_RUN") == tag:
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def _run(cmd, fault=None, kill_after_s=None):
    """Run one `megarl train` (output to a file: processes left by a killed rank would hold a pipe open), then kill
    whatever of it is left. ``kill_after_s``: SIGKILL all of it then, as a node failure would. Returns (exit status,
    or None if killed; output)."""
    tag = uuid.uuid4().hex
    with tempfile.TemporaryFile("w+") as log:
        env = {**_env(fault), "MEGARL_TEST_RUN": tag}
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        try:
            rc = p.wait(timeout=kill_after_s or 600)
        except subprocess.TimeoutExpired:
            rc = None
        _kill_run(tag)
        p.wait()
        log.seek(0)
        return rc, log.read()


def _metrics(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def _tensors(iter_dir, tmp):
    """Every tensor of a checkpoint (weights and optimizer states), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(tmp, os.path.basename(os.path.dirname(os.path.dirname(iter_dir))) + ".pt")
    dcp_to_torch_save(iter_dir, path)
    return {k: v for k, v in torch.load(path, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def chain(request, tiny_llama_dir, tmp_path_factory):
    """The uninterrupted run, and one run stopped four times and resumed each time."""
    name = request.param
    recipe, extra = LAYOUTS[name]
    tmp = tmp_path_factory.mktemp(name)
    ref, cut = tmp / "uninterrupted", tmp / "interrupted"
    log = {}
    rc, log["uninterrupted"] = _run(_cmd(recipe, tiny_llama_dir, ref, extra))
    assert rc == 0, log["uninterrupted"][-4000:]
    cmd = _cmd(recipe, tiny_llama_dir, cut, [*extra, "trainer.keep_last=2"])
    log["save@4"] = _run(cmd, "save@4")  # SIGKILL after step 4's shards, before its manifest
    log["generate@5"] = _run(cmd, "generate@5")  # resumes from step 2; SIGKILL during step 5's generation
    log["sigterm@5"] = _run(cmd, "sigterm@5")  # resumes from step 4; stops after step 5, saved
    # resumes from 5; SIGKILLed at a random moment of its life (start, load, step 6 or its save: ~30 s here)
    delay = random.uniform(2.0, 30.0)  # a different moment every time (printed if a check fails)
    rc, out = _run(cmd, kill_after_s=delay)
    log["random"] = (rc, f"[killed after {delay:.1f} s: {rc is None}]\n{out}")
    killed = rc is None
    log["last"] = _run(cmd) if killed and not (cut / "checkpoints" / f"iter_{STEPS:07d}").exists() else (0, "")
    return {"name": name, "ref": ref, "cut": cut, "log": log, "killed": killed, "tmp": tmp}


def test_each_interruption_stopped_and_resumed_where_expected(chain):
    log = chain["log"]
    assert log["save@4"][0] != 0 and "fault injection: save at step 4" in log["save@4"][1], log["save@4"][1][-3000:]
    assert "resuming from" in log["generate@5"][1] and "iter_0000002 (step 2;" in log["generate@5"][1]
    assert "removed an interrupted save" in log["generate@5"][1], log["generate@5"][1][-3000:]
    assert log["generate@5"][0] != 0 and "fault injection: generate at step 5" in log["generate@5"][1]
    rc, out = log["sigterm@5"]
    assert rc == EXIT_PREEMPTED, out[-4000:]
    assert "iter_0000004 (step 4;" in out and "stopped by SIGTERM after step 5; saved" in out
    assert (chain["cut"] / "checkpoints" / "iter_0000005" / "manifest.json").exists()
    assert log["last"][0] == 0, log["last"][1][-4000:]
    kept = sorted(p.name for p in (chain["cut"] / "checkpoints").glob("iter_*"))
    assert kept == ["iter_0000005", "iter_0000006"]  # trainer.keep_last=2


def test_resumed_metrics_equal_the_uninterrupted_run(chain):
    ref, cut = _metrics(chain["ref"]), _metrics(chain["cut"])
    assert [r["step"] for r in cut] == list(range(1, STEPS + 1))  # continued, never duplicated
    for a, b in zip(ref, cut):
        keys = {k for k in a if not k.startswith(NOT_ALGORITHMIC)}
        assert keys == {k for k in b if not k.startswith(NOT_ALGORITHMIC)}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, f"step {a['step']}"


def test_resumed_weights_and_optimizer_equal_the_uninterrupted_run(chain):
    last = f"checkpoints/iter_{STEPS:07d}"
    ref = _tensors(str(chain["ref"] / last), chain["tmp"])
    cut = _tensors(str(chain["cut"] / last), chain["tmp"])
    assert ref.keys() == cut.keys()
    assert any(k.startswith("optimizer.state.exp_avg.") for k in ref)
    if chain["name"].startswith("ppo"):
        assert any(k.startswith("critic.") for k in ref)
    assert [k for k in ref if not torch.equal(ref[k], cut[k])] == []


@pytest.mark.parametrize("chain", ["grpo_tp2"], indirect=True)
def test_training_checkpoint_exports_to_hf_with_the_actors_logits(chain):
    """`megarl convert megatron-to-hf` reads a training checkpoint's actor; the verify tool then finds the HF
    model's logits equal to the Megatron actor's."""
    ckpt, hf = str(chain["ref"] / "checkpoints"), str(chain["tmp"] / "exported")
    cmd = [sys.executable, "-m", "megarl.cli", "convert", "megatron-to-hf", "--ckpt", ckpt, "--out", hf]
    export = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300)
    assert export.returncode == 0, export.stdout[-2000:] + export.stderr[-3000:]
    verify = subprocess.run([sys.executable, "checkpoints_tools/verify.py", "--hf-dir", hf, "--ckpt", ckpt],
                            capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300)  # fmt: skip
    assert verify.returncode == 0 and verify.stdout.startswith("PASS"), verify.stdout + verify.stderr[-3000:]


RESHARD = {  # resume the uninterrupted run's step-4 checkpoint at another layout
    "ppo_dp2_distopt": ["actor.parallel.tp=2", "actor.parallel.dp=1"],  # DP-sharded Adam states -> TP shards
}


@pytest.mark.parametrize("chain", list(RESHARD), indirect=True)
def test_resume_at_another_layout_reshards_and_says_so(chain, tiny_llama_dir):
    recipe, extra = LAYOUTS[chain["name"]]
    out = chain["tmp"] / "resharded"
    source = chain["ref"] / "checkpoints" / "iter_0000004"
    cmd = _cmd(recipe, tiny_llama_dir, out, [*extra, *RESHARD[chain["name"]], f"trainer.resume={source}"])
    rc, log = _run(cmd)
    assert rc == 0, log[-4000:]
    assert "reshard exactly; the RNG states are per rank and do not carry to another layout" in log
    ref, new = _metrics(chain["ref"]), _metrics(out)
    assert [r["step"] for r in new] == list(range(1, STEPS + 1)) and new[:4] == ref[:4]
    for a, b in zip(ref[4:], new[4:]):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
