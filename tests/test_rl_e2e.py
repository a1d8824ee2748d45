"""The whole RL loop end to end: `megarl train`'s trainer, 3 steps per algorithm, through the real colocated vLLM
engine (CPU build) at TP=2 on 2 ranks; all jobs share one torchrun group and one engine.

Checked per job: the metrics file holds every metric that applies with finite values, each step's samples carry
the weight version of the previous step's update (initial weights: version 0), and the engine's log-probabilities
equal the actor's (fp32). Also: user rewards that raise, hang, exit or return NaN on some samples, W&B offline
and disabled.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from megarl.models.tiny import make_tiny_hf_model
from tests.wandb_reader import history

STEPS = 3
COMMON = [f"trainer.total_steps={STEPS}", "trainer.val_every=0", "logging.wandb.mode=disabled",
          "logging.progress_bar=false", "data.train_batch_size=4", "actor.global_batch_size=32",
          "rollout.sampling.max_new_tokens=6"]  # fmt: skip
FLAKY = """
def flaky(prompts, responses, ground_truths, extras):
    out = []
    for prompt in prompts:
        if int(prompt.split()[1][0]) % 2 == 0:
            raise ValueError("flaky reward: even digit")
        out.append(1.0)
    return out
"""
JOBS = {
    "grpo": ("configs/tiny_grpo.yaml", ["logging.wandb.mode=offline", "trainer.val_every=2", "data.val_batch_size=4"]),
    # PPO starts from a megarl checkpoint of the model (actor, critic body and reference loaded from it)
    "ppo": ("configs/tiny_ppo.yaml", ["data.train_batch_size=8", "actor.global_batch_size=16", "model.path={ckpt}"]),
    # the same PPO job with the training state offloaded while the engine generates (and a save in between)
    "ppo_offload": ("configs/tiny_ppo.yaml", ["data.train_batch_size=8", "actor.global_batch_size=16",
                                              "model.path={ckpt}", "offload.enable=true", "trainer.save_every=2"]),
    "rloo": ("configs/tiny_rloo.yaml", []),
    "reinforce_pp": ("configs/tiny_reinforce_pp.yaml", []),
    "reinforce_pp_baseline": ("configs/tiny_reinforce_pp_baseline.yaml", []),
    "dapo": ("configs/tiny_dapo.yaml", []),
    # LoRA with rollout.lora_merge: whole merged weights into this plain engine (adapter slots: test_lora_sync.py)
    "grpo_lora_merge": ("configs/tiny_grpo_lora.yaml", ["rollout.lora_merge=true"]),
    "flaky": ("configs/tiny_grpo.yaml", ["reward.function={flaky}", "reward.stop_on_error_fraction=null"]),
}
BASE_KEYS = [
    "reward/mean", "reward/std", "reward/errors", "response_length/mean", "response_length/max",
    "response_length/clip_ratio", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
    "actor/grad_norm", "actor/lr", "rollout/logprob_mismatch_mean", "rollout/logprob_mismatch_max",
    "rollout/is_weight_mean", "rollout/tokens_per_s", "sync/seconds", "sync/bytes_sent", "sync/bytes_cross_node",
    "timing/generate", "timing/reward", "timing/ref", "timing/old_logprob", "timing/values", "timing/advantages",
    "timing/update_actor", "timing/update_critic", "timing/sync", "timing/step", "perf/tokens_per_s",
    "perf/padding_frac", "perf/micro_batches", "memory/peak_rss_gb",
]  # fmt: skip
KL_KEYS = ["kl/ref_mean", "kl/coef"]
CRITIC_KEYS = ["critic/vf_loss", "critic/vf_clipfrac", "critic/values_mean", "critic/explained_var",
               "critic/grad_norm"]  # fmt: skip
KL_LOSS_KEYS = ["kl/ref_mean", "actor/kl_loss", "actor/kl_coef"]  # the KL as a loss (kl/coef: the in-reward one)
EXPECTED = {
    "grpo": BASE_KEYS + ["val/reward/mean"],
    "ppo": BASE_KEYS + KL_LOSS_KEYS + CRITIC_KEYS,
    "ppo_offload": BASE_KEYS + KL_LOSS_KEYS + CRITIC_KEYS,
    "rloo": BASE_KEYS,
    "reinforce_pp": BASE_KEYS + KL_KEYS,
    "reinforce_pp_baseline": BASE_KEYS + KL_LOSS_KEYS,
    "dapo": BASE_KEYS + ["reward/overlong_penalty_mean", "dynamic_sampling/gen_rounds"],
    "grpo_lora_merge": BASE_KEYS,
    "flaky": BASE_KEYS,
}
FAULT_JOBS = {  # not in the per-algorithm checks: their updates are skipped on purpose
    "nan": ("configs/tiny_grpo.yaml", ["trainer.save_every=1"], {"MEGARL_FAULT": "nan_loss@2"}),
    "nan_stop": ("configs/tiny_grpo.yaml", ["trainer.max_consecutive_skips=1"], {"MEGARL_FAULT": "nan_loss@2"}),
}
BAD_DIGITS = "479"  # the prompts holding one: one of each step's 4 (trainer.seed=1234)
REWARD_COMMON = ["rollout.sampling.n=4", "actor.global_batch_size=16", "reward.num_workers=4",
                 "trainer.save_samples=true"]  # fmt: skip
REWARD_JOBS = {  # user rewards that misbehave on those prompts' samples (tests/misbehaving_rewards.py), by kind
    "reward_hang": (["reward.function=tests/misbehaving_rewards.py:hang", "reward.timeout_s=2"], "timeout"),
    "reward_sys_exit": (["reward.function=tests.misbehaving_rewards:exits"], "error"),
    "reward_os_exit": (["reward.function=tests/misbehaving_rewards.py:dies"], "error"),
    "reward_nan": (["reward.function=tests.misbehaving_rewards:nan"], "error"),
}
MATCH = 1e-4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl-e2e")
    hf = make_tiny_hf_model(str(tmp / "llama"), "llama", seed=3, init_std=0.08)
    (tmp / "user_reward.py").write_text(FLAKY)
    flaky = f"{tmp / 'user_reward.py'}:flaky"
    ckpt = tmp / "ckpt"
    convert = [sys.executable, "checkpoints_tools/hf_to_megatron.py", "--hf-dir", hf, "--out", str(ckpt)]
    assert subprocess.run(convert, capture_output=True, cwd=REPO, timeout=300).returncode == 0
    jobs = [[name, recipe, COMMON + [o.format(flaky=flaky, ckpt=ckpt) for o in extra], {}]
            for name, (recipe, extra) in JOBS.items()]  # fmt: skip
    jobs += [[name, "configs/tiny_grpo.yaml", COMMON + REWARD_COMMON + extra, {"MEGARL_TEST_BAD_DIGITS": BAD_DIGITS}]
             for name, (extra, _) in REWARD_JOBS.items()]  # fmt: skip
    jobs += [[name, recipe, COMMON + extra, env] for name, (recipe, extra, env) in FAULT_JOBS.items()]
    out = tmp / "out"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "WANDB_DIR": str(tmp),
           "PET_LOG_DIR": str(tmp / "torchelastic"),  # torchrun's log directory (default: a new one in /tmp)
           "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_CONFIG_DIR": str(tmp / "wandb-config")}  # fmt: skip
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node=2", "tests/rl_e2e_worker.py",
         json.dumps({"hf_dir": hf, "out": str(out), "jobs": jobs})],
        env=env, capture_output=True, text=True, timeout=1200, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    names = [*JOBS, *REWARD_JOBS, *FAULT_JOBS]
    logged = {name: [json.loads(line) for line in open(out / name / "metrics.jsonl")] for name in names}
    return {"rows": {name: _steps(rows) for name, rows in logged.items()}, "logged": logged, "out": out,
            "stdout": proc.stdout}  # fmt: skip


def _steps(rows: list[dict]) -> list[dict]:
    """The steps' rows of a metrics.jsonl; a first row at step 0 (trainer.val_before_train) holds val/* only."""
    if rows and rows[0]["step"] == 0:
        assert all(k == "step" or k.startswith("val/") for k in rows[0]) and "val/reward/mean" in rows[0], rows[0]
        return rows[1:]
    return rows


@pytest.mark.parametrize("name", list(JOBS))
def test_every_metric_is_logged_and_finite(runs, name):
    rows = runs["rows"][name]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        missing = [k for k in EXPECTED[name] if k not in r and not (k.startswith("val/") and r["step"] % 2)]
        assert not missing, (name, r["step"], missing)
        bad = {k: v for k, v in r.items() if not (isinstance(v, (int, float)) and math.isfinite(v))}
        assert not bad, (name, bad)
        assert 0 <= r["perf/padding_frac"] < 1 and r["perf/micro_batches"] >= 1, (name, r["step"])


@pytest.mark.parametrize("name", list(JOBS))
def test_samples_carry_the_previous_updates_weights_and_match_the_actor(runs, name):
    for r in runs["rows"][name]:
        assert r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == r["step"] - 1
        assert r["rollout/logprob_mismatch_max"] < MATCH, (name, r["step"], r["rollout/logprob_mismatch_max"])
        assert r["sync/bytes_sent"] > 0 and r["sync/bytes_cross_node"] == 0  # one node


def test_reward_errors_score_zero_and_are_counted(runs):
    rows = runs["rows"]["flaky"]
    samples = 4 * 8  # 4 prompts x 8 samples; the prompts with an even digit raise
    for r in rows:
        assert r["reward/mean"] == pytest.approx(1 - r["reward/errors"] / samples, abs=1e-12)
    assert any(0 < r["reward/errors"] < samples for r in rows)
    assert runs["stdout"].count("the reward function failed on some samples; they score 0") == 1 + len(REWARD_JOBS)
    assert "flaky reward: even digit" in runs["stdout"]


@pytest.mark.parametrize("name", list(REWARD_JOBS))
def test_a_misbehaving_reward_costs_exactly_its_samples(runs, name):
    """It hangs (reward.timeout_s=2), calls sys.exit(0), os._exit(1) or returns NaN on the samples of the prompts
    holding a BAD_DIGIT: every step completes, exactly those samples score 0 and are counted (and as timeouts for
    the hang); no reward worker is left when the job ends, and the next job works."""
    kind = REWARD_JOBS[name][1]
    rows = runs["rows"][name]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        path = runs["out"] / name / "samples" / f"step_{r['step']:07d}.jsonl"
        samples = [json.loads(line) for line in open(path)]
        bad = [any(d in s["prompt"] for d in BAD_DIGITS) for s in samples]
        assert len(samples) == 16 and 0 < sum(bad) < 16, (r["step"], [s["prompt"] for s in samples])
        assert [s["failed"] for s in samples] == [kind if b else "" for b in bad]
        assert [s["score"] for s in samples] == [0.0 if b else 1.0 for b in bad]
        assert r["reward/errors"] == sum(bad)
        assert r["reward/timeouts"] == (sum(bad) if kind == "timeout" else 0)
    for rank in (0, 1):
        assert json.loads((runs["out"] / name / f"reward_workers_left.rank{rank}").read_text()) == []


def test_wandb_offline_run_holds_the_logged_keys(runs):
    """Read the offline run file back (wandb's own record schema) and compare it with metrics.jsonl."""
    wandb_dir = runs["out"] / "grpo" / "wandb"
    run_dirs = [d for d in os.listdir(wandb_dir) if d.startswith("offline-run-")]
    assert len(run_dirs) == 1
    run_file = next((wandb_dir / run_dirs[0]).glob("run-*.wandb"))
    logged = history(str(run_file))
    rows = runs["logged"]["grpo"]  # the validation before training (step 0) included
    assert rows[0]["step"] == 0 and [h["_step"] for h in logged] == [r["step"] for r in rows]
    for h, r in zip(logged, rows):
        for key, value in r.items():
            if key != "step":
                assert h[key] == pytest.approx(value), key


def test_the_kl_loss_and_the_in_reward_kl_have_their_own_coefficient_names(runs):
    for name in ("ppo", "reinforce_pp_baseline"):  # a KL loss, no KL in the reward
        assert all("actor/kl_coef" in r and "kl/coef" not in r for r in runs["rows"][name]), name
    assert all("kl/coef" in r and "actor/kl_coef" not in r for r in runs["rows"]["reinforce_pp"])


def test_ppo_from_a_megarl_checkpoint_starts_from_the_same_policy(runs):
    """The PPO job loaded actor, reference and critic body from a converted checkpoint: its first step's KL to the
    reference is 0 (same weights) and the engine matched the actor (checked above for every job)."""
    first = runs["rows"]["ppo"][0]
    assert first["kl/ref_mean"] == pytest.approx(0.0, abs=1e-6)
    assert first["critic/values_mean"] == 0.0  # the value head starts at zero


def test_offloading_during_generation_changes_nothing_the_algorithm_sees(runs):
    """Actor grads and optimizer state, critic and reference went to host memory and back every step (and around
    the step-2 save): every algorithmic metric equals the PPO job that never offloaded, exactly."""
    timing = ("timing/", "perf/", "memory/", "sync/seconds", "rollout/tokens_per_s")
    plain, offloaded = runs["rows"]["ppo"], runs["rows"]["ppo_offload"]
    for a, b in zip(plain, offloaded):
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == {
            k: v for k, v in b.items() if not k.startswith(timing)
        }
    assert (runs["out"] / "ppo_offload" / "checkpoints" / "iter_0000002" / "manifest.json").is_file()


def test_wandb_disabled_writes_nothing(runs):
    assert not (runs["out"] / "rloo" / "wandb").exists()
    assert (runs["out"] / "rloo" / "reward_curve.png").is_file() and (runs["out"] / "rloo" / "config.yaml").is_file()


def _checkpoint_tensors(iter_dir, tmp):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(tmp, os.path.basename(iter_dir) + ".pt")
    dcp_to_torch_save(iter_dir, path)
    return {k: v for k, v in torch.load(path, weights_only=False).items() if isinstance(v, torch.Tensor)}


def test_a_non_finite_loss_skips_that_steps_update(runs, tmp_path):
    """MEGARL_FAULT=nan_loss@2: step 2's actor loss is NaN; its update is skipped (weights and Adam state after
    step 2 equal those after step 1), counted, and step 3 trains again."""
    import torch

    rows = runs["rows"]["nan"]
    assert [r["train/skipped_steps"] for r in rows] == [0, 1, 1]
    assert "actor/pg_loss" in rows[0] and "actor/pg_loss" not in rows[1] and "actor/pg_loss" in rows[2]
    assert "step 2: update skipped (actor: non-finite" in runs["stdout"]
    ckpts = runs["out"] / "nan" / "checkpoints"
    s1, s2, s3 = (_checkpoint_tensors(str(ckpts / f"iter_{i:07d}"), tmp_path) for i in (1, 2, 3))
    assert any(k.startswith("optimizer.state.exp_avg.") for k in s1)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not torch.equal(s2["output_layer.weight"], s3["output_layer.weight"])


def test_consecutive_non_finite_steps_stop_the_run_with_a_clear_error(runs):
    error = (runs["out"] / "nan_stop" / "error.txt").read_text()
    assert "1 consecutive RL step(s) had a non-finite loss or gradients" in error
    assert "trainer.max_consecutive_skips=1" in error and "Lower the learning rate" in error
    assert [r["step"] for r in runs["rows"]["nan_stop"]] == [1]
