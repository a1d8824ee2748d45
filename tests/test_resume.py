"""Exact resume through the real `megarl train` command: a run killed at named points (SIGKILL mid-generation,
SIGKILL mid-save) and once at a random moment from outside, and stopped by SIGTERM (in a generation, as a step waits
for its scores, in a validation, in an update), resumed with trainer.resume=auto each time, ends with the same
metrics (every algorithmic one, equal floats) and the same weights and optimizer states (equal tensors) as the run
that was never stopped: a cut rollout is dropped and regenerated bitwise. GRPO at TP=2 and PPO (critic) at TP=1 x
DP=2 with the distributed optimizer.

bf16 (the production dtype): the quickstart at TP=2, at PP=2 and at DP=2 with the distributed optimizer saves every
step, is killed in a generation (``MEGARL_FAULT``) and from outside at a random moment, and resumes bitwise. The
features in bf16 (PPO with critic, reference and a reward model, LoRA merged and in adapter slots, pools,
one-step-off, bounded) are ``slow`` chains of one kill and one resume.

Multi-turn tool episodes (``TOOLS``) run in the LoRA chain (colocated, adapter slots) and the one-step-off chain (its
batch ahead, whole episodes, held in the checkpoint), which resume exactly too.
"""

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass

import pytest
import torch

from megarl.run.resume import EXIT_PREEMPTED
from tests.leftovers import alive_after

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
COMMON = [f"trainer.total_steps={STEPS}", "trainer.save_every=2", "trainer.val_every=0", "logging.wandb.mode=disabled",
          "logging.progress_bar=false", "data.train_batch_size=4", "actor.global_batch_size=32",
          "rollout.sampling.max_new_tokens=6"]  # fmt: skip
TWO_MINIBATCHES = "actor.global_batch_size=16"
"""The old log-probs are computed (``rollout/logprob_mismatch_*`` is logged)."""
TOOLS = ["env.class=tests/envs.py:AlwaysCalls", "env.kwargs.tools=[megarl.env.tools:calculator]",
         "env.kwargs.calls=1", "env.max_turns=2",
         "env.max_total_tokens=640", "rollout.max_model_len=768", "actor.seq_length=768", "rollout.kv_cache_mb=32",
         "env.num_workers=2"]  # fmt: skip
"""Multi-turn episodes of tool calls (configs/tiny_tools.yaml's settings; every episode calls the calculator once,
tests/envs.py), on the LoRA chain (colocated) and the one-step-off chain (its batch ahead: whole episodes)."""
LAYOUTS = {
    "grpo_tp2": ("configs/tiny_grpo.yaml", [TWO_MINIBATCHES]),
    "grpo_pools": ("configs/tiny_grpo_pools.yaml", [TWO_MINIBATCHES, "trainer.val_every=2"]),  # grpo_tp2 with
    # rollout on ranks 2-3, validated every second step (a stop cuts step 4's validation)
    "grpo_async": ("configs/tiny_grpo_async.yaml", TOOLS),  # grpo_pools, one-step-off, tool episodes
    "grpo_bounded": ("configs/tiny_grpo_bounded.yaml", ["trainer.save_samples=true",  # streaming, max_staleness 2;
                                                        "rollout.sampling.max_new_tokens=48",  # saves hold partials;
                                                        *TOOLS]),  # tool episodes (saved with their state_dict)
    "grpo_lora_tp2": ("configs/tiny_grpo.yaml", ["actor.lora.rank=4", "actor.optim.lr=0.001",  # adapter slots:
                                                 "actor.lora.target_modules=[q_proj,v_proj,down_proj]",  # base, then
                                                 "rollout.lora_merge=false", *TOOLS]),  # adapters again after the
    # resume; tool episodes
    "ppo_dp2_distopt": (
        "configs/tiny_ppo.yaml",
        ["actor.parallel.tp=1", "actor.parallel.dp=2", "actor.optim.use_distributed_optimizer=true",
         "critic.optim.use_distributed_optimizer=true", "data.train_batch_size=8", "actor.global_batch_size=16"],
    ),
}  # fmt: skip
BF16 = ["model.dtype=bfloat16"]
TWO_MINIBATCHES_PPO = "actor.global_batch_size=8"
"""PPO samples 4 per prompt: 16 per step, two mini-batches of 8."""
LAYOUTS.update({
    "bf16_tp2": ("configs/quickstart.yaml", [*BF16, "trainer.save_every=1", TWO_MINIBATCHES]),
    "bf16_pp2": ("configs/quickstart.yaml", [*BF16, "trainer.save_every=1", TWO_MINIBATCHES, "actor.parallel.tp=1",
                                             "actor.parallel.pp=2"]),
    "bf16_dp2_distopt": ("configs/quickstart.yaml", [*BF16, "trainer.save_every=1", TWO_MINIBATCHES,
                                                     "actor.parallel.tp=1", "actor.parallel.dp=2",
                                                     "actor.optim.use_distributed_optimizer=true"]),
    # slow: the features in bf16 ({rm}: a tiny reward model, built when a chain names it)
    "bf16_ppo_lora_rm": ("configs/tiny_ppo.yaml", [*BF16, TWO_MINIBATCHES_PPO, "actor.lora.rank=4",
                                                  "actor.optim.lr=0.001", "rollout.lora_merge=true",
                                                  "reward.model.path={rm}"]),
    "bf16_lora_slots": ("configs/tiny_grpo.yaml", [*BF16, *LAYOUTS["grpo_lora_tp2"][1], "actor.kl_loss_coef=0.01"]),
    "bf16_ppo_pools": ("configs/tiny_ppo_pools.yaml", [*BF16, TWO_MINIBATCHES_PPO]),  # critic, reference: own pool
    "bf16_async": ("configs/tiny_grpo_async.yaml", [*BF16, "trainer.save_samples=true"]),
    "bf16_bounded": ("configs/tiny_grpo_bounded.yaml", [*BF16, "trainer.save_samples=true",  # single-turn
                                                        "rollout.sampling.max_new_tokens=48"]),
    # a tiny Qwen3-MoE ({moe}) with its experts split over EP=2, the distributed optimizer on, the engine's routes
    # replayed in the actor (rollout routing replay)
    "grpo_moe_ep2": ("configs/tiny_grpo_qwen3_moe.yaml", ["model.path={moe}", TWO_MINIBATCHES,
                                                          "actor.optim.use_distributed_optimizer=true",
                                                          "actor.moe_routing_replay=rollout"]),  # fmt: skip
})  # fmt: skip
SHORT = ("grpo_lora_tp2", "grpo_pools", "bf16_ppo_lora_rm", "bf16_lora_slots", "bf16_ppo_pools", "grpo_moe_ep2")
"""Chains of one kill and one resume (the others are stopped five ways)."""
OUTSIDE = ("grpo_async", "grpo_bounded", "bf16_async", "bf16_bounded")
"""Chains of one kill from outside at a random moment (`megarl train` SIGKILLed) and one resume."""
TWO_KILLS = ("bf16_tp2", "bf16_pp2", "bf16_dp2_distopt")
"""Saved every step; killed in step 3's generation, resumed; killed from outside at a random moment, resumed."""
BOUNDED = ("grpo_bounded", "bf16_bounded")
"""Not bitwise: when the rollout pool serves a push follows the wall clock (the prompts trained are exact)."""
SLOW = ("bf16_ppo_lora_rm", "bf16_lora_slots", "bf16_ppo_pools", "bf16_async", "bf16_bounded")


def _chains(names) -> list:
    """``names`` as parameters of the ``chain`` fixture, the slow ones marked."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


FIRST_KILLS = {"grpo_tp2": "save@4", "ppo_dp2_distopt": "publish@2"}
"""The first kill of each fully interrupted chain: rank 0 SIGKILLed after step 4's shards and before its manifest
(the next start removes the save and resumes from step 2), or after step 2's manifest and before the renames that
publish it (the next start finishes the publish and resumes from step 2: before, it removed the save, and with no
other checkpoint refused to start)."""
FULL_STOPS = {"grpo_tp2": "sigterm@5", "ppo_dp2_distopt": "sigterm_update@5"}
"""The stop of each fully interrupted chain: SIGTERM as step 5 starts (its generation is cut, the step dropped) or
as its update starts (the update finishes, the step is saved)."""
STOP_IN_VALIDATION = ("grpo_pools",)
"""Chains first stopped by SIGTERM during step 4's validation."""
STOP_IN_SCORING = ("bf16_dp2_distopt",)
"""Chains stopped by SIGTERM as step 4 waits for its scores."""
STOP_MID_STEP = {"bf16_async": "sigterm_ahead@6", "bf16_bounded": "sigterm@5"}
"""One-step-off: SIGTERM on the rollout pool as it generates step 6's batch ahead (dropped, the data cursor rewound;
step 5 finishes and is saved); bounded: SIGTERM as step 5 starts (the learners drop it and save step 4 with the
stream, or, when the batch was handed over first, step 5 finishes and is saved). Not bitwise: the batch is generated
again with newer weights; each prompt is still trained once, in order."""
EXACT = _chains(name for name in LAYOUTS if name not in BOUNDED and name not in STOP_MID_STEP)
FULL = [name for name in LAYOUTS if name not in SHORT + OUTSIDE + TWO_KILLS]
NOT_ALGORITHMIC = ("timing/", "perf/", "memory/", "sync/seconds", "rollout/tokens_per_s", "pool/", "env/step_seconds")


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


def _shm():
    return set(os.listdir("/dev/shm"))


def _wait_for_line_after(path, text, previous, timeout_s):
    """Wait for ``text``; the time ``previous`` was first seen (True if never): None on a timeout."""
    deadline, seen = time.time() + timeout_s, True
    while time.time() < deadline:
        out = open(path).read()
        if seen is True and previous in out:
            seen = time.time()
        if text in out:
            return seen
        time.sleep(0.05)
    return None


def _wait_for(path, text, timeout_s):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if text in open(path).read():
            return True
        time.sleep(0.05)
    return False


@dataclass
class Run:
    """One `megarl train` and what it left behind, looked at right after it ended (before anything else ran)."""

    rc: int | None
    """Exit status; None when the test SIGKILLed the launcher."""
    out: str
    alive_after_10s: list[str]
    """Processes of the run still alive 10 s after it ended (or after its launcher was killed)."""
    shm_left: set[str]
    """Entries the run added to /dev/shm and left there."""


def _run(cmd, fault=None, kill_launcher_after=None):
    """Run one `megarl train` (output to a file: a process left behind would hold a pipe open) and look at `ps` and
    /dev/shm right after. ``kill_launcher_after=(line, max_delay_s)``: SIGKILL the `megarl train` process itself (not
    its ranks) a random moment up to ``max_delay_s`` after ``line`` (``[megarl] step N/M``) appears in its output, and
    at most one step's time after it (the time from step N-1's line to step N's): the run is still in step N + 1 then,
    however fast its steps and saves are (CI once killed a run that had already finished all of its steps)."""
    tag = uuid.uuid4().hex
    before = _shm()
    with tempfile.NamedTemporaryFile("w+") as log:
        env = {**_env(fault), "MEGARL_TEST_RUN": tag}
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        killed = False
        if kill_launcher_after is not None:
            line, max_delay_s = kill_launcher_after
            step, total = map(int, re.fullmatch(r"\[megarl\] step (\d+)/(\d+)", line).groups())
            seen = _wait_for_line_after(log.name, line, f"[megarl] step {step - 1}/{total}", 300)
            if seen and p.poll() is None:
                one_step = max_delay_s if seen is True else time.time() - seen  # a resumed run may start at N
                time.sleep(random.uniform(0, min(max_delay_s, one_step)))  # a different moment every run
                p.kill()
                killed = True
        try:
            rc = p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        left = alive_after(tag, 10)
        alive = [f"{q.pid} {' '.join(q.cmdline()[:6])}" for q in left]
        shm_left = _shm() - before
        for q in left:  # only after looking: a leftover fails the test, and must not hang the next run
            q.kill()
        log.seek(0)
        return Run(None if killed else rc, log.read(), alive, shm_left)


def _stop_seconds(out: str) -> float:
    """How long the stop took, as the run says it ('the stop took 0.4 s')."""
    return float(re.search(r"the stop took ([0-9.]+) s", out).group(1))


def _metrics(out_dir, with_step_0: bool = False):
    """metrics.jsonl's rows; without the validation before training (step 0, val/* only) unless asked."""
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return rows if with_step_0 else [r for r in rows if r["step"] > 0]


def _tensors(iter_dir, tmp):
    """Every tensor of a checkpoint (weights and optimizer states), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(tmp, os.path.basename(os.path.dirname(os.path.dirname(iter_dir))) + ".pt")
    dcp_to_torch_save(iter_dir, path)
    return {k: v for k, v in torch.load(path, weights_only=False).items() if isinstance(v, torch.Tensor)}


UNINTERRUPTED = {}
"""Layout name -> the output dir of its uninterrupted run (the pooled run is compared with the colocated one)."""


@pytest.fixture(scope="module", params=_chains(LAYOUTS))
def chain(request, tiny_llama_dir, tmp_path_factory):
    """The uninterrupted run, and one run stopped five times and resumed each time; each run is looked at (`ps`,
    /dev/shm) right after it ended."""
    name = request.param
    recipe, extra = LAYOUTS[name]
    tmp = tmp_path_factory.mktemp(name)
    if any("{rm}" in e for e in extra):
        from megarl.models.tiny import make_tiny_hf_model

        rm = make_tiny_hf_model(str(tmp / "reward-model"), "llama", seed=7, init_std=0.08, num_labels=1)
        extra = [e.format(rm=rm) for e in extra]
    if any("{moe}" in e for e in extra):
        from megarl.models.tiny import make_tiny_hf_model

        moe = make_tiny_hf_model(str(tmp / "moe"), "qwen3_moe")
        extra = [e.replace("{moe}", moe) for e in extra]
    ref, cut = tmp / "uninterrupted", tmp / "interrupted"
    runs = {"uninterrupted": _run(_cmd(recipe, tiny_llama_dir, ref, extra))}
    assert runs["uninterrupted"].rc == 0, runs["uninterrupted"].out[-4000:]
    UNINTERRUPTED[name] = ref
    cmd = _cmd(recipe, tiny_llama_dir, cut, [*extra, "trainer.keep_last=2"])
    if name in OUTSIDE:  # killed at a random moment of steps 4-5 (saved at 2, maybe 4), then resumed
        runs["launcher"] = _run(cmd, kill_launcher_after=("[megarl] step 3/6", 0.3))
        if name in STOP_MID_STEP:  # then stopped by SIGTERM in step 5 (see STOP_MID_STEP), resumed again
            runs["sigterm"] = _run(cmd, STOP_MID_STEP[name])
        runs["last"] = _run(cmd)
        return {"name": name, "ref": ref, "cut": cut, "runs": runs, "tmp": tmp}
    if name in TWO_KILLS:  # saved every step: rank 0 SIGKILLed in step 3's generation (resumes from 2), then
        runs["generate@3"] = _run(cmd, "generate@3")  # `megarl train` SIGKILLed at a random moment of steps 4-6
        if name in STOP_IN_SCORING:  # first a SIGTERM as step 4 waits for its scores: dropped, resumes from 3
            runs["sigterm_reward@4"] = _run(cmd, "sigterm_reward@4")
        runs["launcher"] = _run(cmd, kill_launcher_after=("[megarl] step 4/6", 0.5))
        runs["last"] = _run(cmd)
        return {"name": name, "ref": ref, "cut": cut, "runs": runs, "tmp": tmp}
    if name in SHORT:  # one kill: rank 0 SIGKILLed in step 5's generation (saved at 2 and 4), then resumed from 4
        if name in STOP_IN_VALIDATION:  # first stopped by SIGTERM in step 4's validation (saved, validated on resume)
            runs["sigterm_validate@4"] = _run(cmd, "sigterm_validate@4")
        runs["generate@5"] = _run(cmd, "generate@5")
        runs["last"] = _run(cmd)
        return {"name": name, "ref": ref, "cut": cut, "runs": runs, "tmp": tmp}
    runs["save@4"] = _run(cmd, FIRST_KILLS[name])  # see FIRST_KILLS
    # resumes from step 2; `megarl train` itself SIGKILLed at a random moment of steps 4-6 (a node failure)
    runs["launcher"] = _run(cmd, kill_launcher_after=("[megarl] step 3/6", 0.3))
    runs["generate@5"] = _run(cmd, "generate@5")  # resumes from 2 or 4; rank 0 SIGKILLed in step 5's generation
    runs["sigterm"] = _run(cmd, FULL_STOPS[name])  # resumes from step 4; SIGTERM in step 5 (see FULL_STOPS)
    runs["last"] = _run(cmd)  # resumes from 5
    return {"name": name, "ref": ref, "cut": cut, "runs": runs, "tmp": tmp}


@pytest.mark.parametrize("chain", FULL, indirect=True)
def test_each_interruption_stopped_and_resumed_where_expected(chain):
    runs = chain["runs"]
    save, launcher, generate, sigterm = runs["save@4"], runs["launcher"], runs["generate@5"], runs["sigterm"]
    fault = FIRST_KILLS[chain["name"]]
    assert save.rc not in (0, None) and f"fault injection: {fault.replace('@', ' at step ')}" in save.out, save.out
    assert "iter_0000002 (step 2;" in launcher.out, launcher.out
    if fault.startswith("save"):  # cut before the manifest: removed
        assert "removed an interrupted save" in launcher.out, launcher.out
    else:  # cut between the manifest and the renames: the start finished the publish
        assert "finished an interrupted save: " in launcher.out and "iter_0000002.tmp -> iter_0000002" in launcher.out
    assert launcher.rc is None, launcher.out[-3000:]  # killed mid-run
    assert re.search(r"iter_000000[24] \(step [24];", generate.out), generate.out[-3000:]
    assert generate.rc not in (0, None) and "fault injection: generate at step 5" in generate.out
    assert sigterm.rc == EXIT_PREEMPTED, sigterm.out[-4000:]
    assert "iter_0000004 (step 4;" in sigterm.out
    if FULL_STOPS[chain["name"]].startswith("sigterm@"):  # the generation is cut: step 4's checkpoint holds the state
        assert "stopped by SIGTERM during step 5's rollout: it is dropped; its checkpoint holds step 4" in sigterm.out
        assert "saved step 5" not in sigterm.out
    else:  # the update finishes, then the step is saved
        assert "stopped by SIGTERM after step 5; saved" in sigterm.out, sigterm.out[-4000:]
        assert (chain["cut"] / "checkpoints" / "iter_0000005" / "manifest.json").exists()
    assert _stop_seconds(sigterm.out) < 25  # trainer.stop_grace_s
    assert runs["last"].rc == 0, runs["last"].out[-4000:]
    kept = sorted(p.name for p in (chain["cut"] / "checkpoints").glob("iter_*"))
    assert kept[-1] == "iter_0000006" and len(kept) == 2  # trainer.keep_last=2


@pytest.mark.parametrize("chain", TWO_KILLS, indirect=True)
def test_bf16_runs_killed_twice_stopped_and_resumed_where_expected(chain):
    runs = chain["runs"]
    generate, launcher, last = runs["generate@3"], runs["launcher"], runs["last"]
    assert generate.rc not in (0, None) and "fault injection: generate at step 3" in generate.out, generate.out[-3000:]
    assert "saved step 2:" in generate.out and "saved step 3:" not in generate.out
    resumed = 2
    if "sigterm_reward@4" in runs:  # cut while step 4 waited for its scores: dropped, step 3 was saved
        stop = runs["sigterm_reward@4"]
        assert stop.rc == EXIT_PREEMPTED, stop.out[-4000:]
        assert "during step 4's rollout: it is dropped; its checkpoint holds step 3" in stop.out, stop.out[-3000:]
        assert _stop_seconds(stop.out) < 25
        resumed = 3
    assert f"iter_000000{resumed} (step {resumed};" in launcher.out and launcher.rc is None, launcher.out[-3000:]
    assert re.search(r"iter_000000[3-6] \(step [3-6];", last.out) and last.rc == 0, last.out[-3000:]
    kept = sorted(p.name for p in (chain["cut"] / "checkpoints").glob("iter_*"))
    assert kept == ["iter_0000005", "iter_0000006"]  # trainer.keep_last=2


def test_a_rank_killed_mid_run_takes_its_run_down_and_leaves_no_shared_memory(chain):
    """Rank 0 SIGKILLed (mid-generation at TP=2 with vLLM, and mid-save): the launcher kills the other rank at once
    (it would spin in vLLM's shared-memory all-reduce), says so in one line, and the run's /dev/shm files are gone;
    the next run on this machine works (`sigterm@5`, then `last`)."""
    for fault in [f for f in ("generate@3", "generate@5", "save@4") if f in chain["runs"]]:
        run = chain["runs"][fault]
        assert run.alive_after_10s == [], (fault, run.alive_after_10s, run.out[-3000:])
        assert run.shm_left == set(), (fault, run.shm_left)
        deaths = [line for line in run.out.splitlines() if "died without finishing" in line]
        assert len(deaths) == 1 and deaths[0].startswith("[megarl] rank 0 (pid "), (fault, run.out[-3000:])
        assert "killed the" in deaths[0] and "other process(es) of this run at once" in deaths[0]


@pytest.mark.parametrize("chain", FULL + _chains(OUTSIDE + TWO_KILLS), indirect=True)
def test_a_killed_launcher_takes_its_ranks_with_it_and_the_next_run_sweeps_its_shared_memory(chain):
    """`megarl train` SIGKILLed mid-run: within 10 s no rank, agent or helper of it is alive (they die with their
    parent at kernel level); what it left in /dev/shm is removed by the next run, which works."""
    runs = chain["runs"]
    assert runs["launcher"].alive_after_10s == [], runs["launcher"].alive_after_10s
    left = runs["launcher"].shm_left
    assert left and all(n.startswith("megarl-") for n in left), left  # its lock and rank files, vLLM's segments
    assert left.isdisjoint(_shm()), left & _shm()
    after = runs.get("generate@5", runs.get("sigterm", runs["last"]))  # the next run
    assert "left in /dev/shm by runs that are gone" in after.out, after.out[-3000:]


def test_no_run_leaves_a_process_or_shared_memory_behind(chain):
    for label, run in chain["runs"].items():
        assert run.alive_after_10s == [], (label, run.alive_after_10s)
        if label != "launcher":
            assert run.shm_left == set(), (label, run.shm_left)


@pytest.mark.parametrize("chain", _chains(["bf16_async"]), indirect=True)
def test_one_step_off_stopped_while_generating_ahead_trains_each_prompt_once_in_order(chain):
    """The batch ahead is dropped and the data cursor rewound; the resumed run generates it again (with newer
    weights: not bitwise) and trains the same prompts, in the same order, as the uninterrupted run."""
    stop = chain["runs"]["sigterm"]
    assert stop.rc == EXIT_PREEMPTED, stop.out[-4000:]
    assert "the rollout pool dropped step 6's batch ahead" in stop.out, stop.out[-3000:]
    assert "stopped by a signal on another rank after step 5; saved" in stop.out, stop.out[-3000:]
    assert _stop_seconds(stop.out) < 25
    assert "saved step 5:" in stop.out
    ref, cut = _trained(chain["ref"]), _trained(chain["cut"])
    assert sorted(cut) == list(range(1, STEPS + 1))
    assert {s: sorted(cut[s]) for s in cut} == {s: sorted(ref[s]) for s in ref}
    assert [r["step"] for r in _metrics(chain["cut"])] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("chain", [n for n in SHORT if n in STOP_IN_VALIDATION], indirect=True)
def test_a_stop_during_validation_saves_its_step_and_the_resume_validates_it_again(chain):
    stop = chain["runs"]["sigterm_validate@4"]
    assert stop.rc == EXIT_PREEMPTED, stop.out[-4000:]
    assert "during step 4's validation; saved step 4, to validate again on resume" in stop.out, stop.out[-3000:]
    assert _stop_seconds(stop.out) < 25
    assert "resuming from" in chain["runs"]["generate@5"].out and "(step 4;" in chain["runs"]["generate@5"].out
    rows = _metrics(chain["cut"], with_step_0=True)  # the starting weights validated once, not again on resume
    assert [r["step"] for r in rows] == list(range(0, STEPS + 1))
    assert all("val/reward/mean" in r for r in rows if r["step"] % 2 == 0)
    algorithmic = lambda row: {k: v for k, v in row.items() if not k.startswith(NOT_ALGORITHMIC)}  # noqa: E731
    assert algorithmic(rows[0]) == algorithmic(_metrics(chain["ref"], with_step_0=True)[0])  # same weights, prompts


@pytest.mark.parametrize("chain", EXACT, indirect=True)
def test_resumed_metrics_equal_the_uninterrupted_run(chain):
    ref, cut = _metrics(chain["ref"]), _metrics(chain["cut"])
    assert [r["step"] for r in cut] == list(range(1, STEPS + 1))  # continued, never duplicated
    for a, b in zip(ref, cut):
        keys = {k for k in a if not k.startswith(NOT_ALGORITHMIC)}
        assert keys == {k for k in b if not k.startswith(NOT_ALGORITHMIC)}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, f"step {a['step']}"


@pytest.mark.parametrize("chain", EXACT, indirect=True)
def test_resumed_weights_and_optimizer_equal_the_uninterrupted_run(chain):
    last = f"checkpoints/iter_{STEPS:07d}"
    ref = _tensors(str(chain["ref"] / last), chain["tmp"])
    cut = _tensors(str(chain["cut"] / last), chain["tmp"])
    assert ref.keys() == cut.keys()
    assert any(k.startswith(("optimizer.state.exp_avg.", "chained_0.optimizer.state.exp_avg.")) for k in ref)
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


@pytest.mark.parametrize("chain", ["grpo_lora_tp2"], indirect=True)
def test_lora_checkpoints_hold_only_adapters_and_refuse_another_base(chain, tmp_path):
    """A LoRA checkpoint holds the adapters and their optimizer state (not the frozen base); resuming it onto another
    base model stops with one line."""
    from megarl.models.tiny import make_tiny_hf_model

    runs = chain["runs"]
    assert "fault injection: generate at step 5" in runs["generate@5"].out, runs["generate@5"].out[-3000:]
    assert "iter_0000004 (step 4;" in runs["last"].out and runs["last"].rc == 0, runs["last"].out[-3000:]
    names = _tensors(str(chain["ref"] / f"checkpoints/iter_{STEPS:07d}"), chain["tmp"]).keys()
    assert names and all(".lora_" in k for k in names), sorted(names)[:5]
    other = make_tiny_hf_model(str(tmp_path / "other"), "llama", seed=5)
    recipe, extra = LAYOUTS["grpo_lora_tp2"]
    source = chain["ref"] / "checkpoints" / "iter_0000004"
    one_rank = ["actor.parallel.tp=1", "rollout.backend=hf", "rollout.lora_merge=auto"]  # refused before any engine
    # starts; one process
    run = _run(_cmd(recipe, other, tmp_path / "out", [*extra, *one_rank, f"trainer.resume={source}"]))
    assert run.rc == 1, run.out[-3000:]
    lines = [line for line in run.out.splitlines() if "its adapters were trained on another base model" in line]
    assert len(lines) == 1 and lines[0].startswith("megarl: ") and "Traceback" not in run.out, run.out[-3000:]


@pytest.mark.parametrize("chain", ["grpo_lora_tp2"], indirect=True)
def test_lora_checkpoint_exports_as_a_peft_adapter_and_as_a_merged_model(chain, tiny_llama_dir):
    """`megarl convert megatron-to-hf --lora` writes the checkpoint's adapters bitwise as a PEFT directory that peft
    loads and init_from reads back bitwise; `--merge` gives the same logits as base + adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.config.loader import load_config
    from megarl.lora import read_peft_adapter
    from megarl.models import read_hf_config, spec_from_hf_config

    ckpt = str(chain["ref"] / "checkpoints")
    outs = {flag: str(chain["tmp"] / f"export{flag}") for flag in ("--lora", "--merge")}
    for flag, out in outs.items():
        cmd = [sys.executable, "-m", "megarl.cli", "convert", "megatron-to-hf", "--ckpt", ckpt, "--out", out, flag]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    every = _tensors(str(chain["ref"] / f"checkpoints/iter_{STEPS:07d}"), chain["tmp"])  # with optimizer states
    saved = {k.removeprefix("lora."): v for k, v in every.items() if k.startswith("lora.")}
    exported = load_file(f"{outs['--lora']}/adapter_model.safetensors")
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    recipe, extra = LAYOUTS["grpo_lora_tp2"]
    lora = load_config(recipe, [f"model.path={tiny_llama_dir}", *extra]).actor.lora
    back = read_peft_adapter(outs["--lora"], lora, spec_from_hf_config(read_hf_config(tiny_llama_dir)))
    assert all(torch.equal(back[k], saved[k]) for k in saved)  # init_from reads it back bitwise
    tokens = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        plain = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, outs["--lora"])(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(outs["--merge"], dtype=torch.float32)(tokens).logits
    assert (merged - adapted).abs().max() <= 1e-5
    assert (adapted - plain).abs().max() > 1e-4  # six steps moved the adapters off B = 0


RESHARD = {  # resume the uninterrupted run's step-4 checkpoint at another layout
    "ppo_dp2_distopt": ["actor.parallel.tp=2", "actor.parallel.dp=1"],  # DP-sharded Adam states -> TP shards
}


@pytest.mark.parametrize("chain", list(RESHARD), indirect=True)
def test_resume_at_another_layout_reshards_and_says_so(chain, tiny_llama_dir):
    recipe, extra = LAYOUTS[chain["name"]]
    out = chain["tmp"] / "resharded"
    source = chain["ref"] / "checkpoints" / "iter_0000004"
    cmd = _cmd(recipe, tiny_llama_dir, out, [*extra, *RESHARD[chain["name"]], f"trainer.resume={source}"])
    run = _run(cmd)
    assert run.rc == 0 and run.alive_after_10s == [] and run.shm_left == set(), run.out[-4000:]
    log = run.out
    assert "reshard exactly; the RNG states are per rank and do not carry to another layout" in log
    ref, new = _metrics(chain["ref"]), _metrics(out)
    assert [r["step"] for r in new] == list(range(1, STEPS + 1)) and new[:4] == ref[:4]
    for a, b in zip(ref[4:], new[4:]):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)


POOLED = ("timing/", "perf/", "memory/", "sync/", "pool/", "rollout/tokens_per_s")
"""What placement may change: times, throughputs, memory, the sync's bytes (across pools every byte moves)."""


@pytest.mark.parametrize("chain", ["grpo_pools"], indirect=True)
def test_placement_does_not_change_the_algorithm(chain, tiny_llama_dir, tmp_path):
    """configs/tiny_grpo_pools.yaml (actor on ranks 0-1, the engine on ranks 2-3) against tiny_grpo.yaml colocated
    on 2 ranks: every other metric equal as floats, at every step (6 >= 3); the pooled chain also validates."""
    colocated = UNINTERRUPTED.get("grpo_tp2")
    if colocated is None:  # this test alone (-k): run the colocated reference here
        colocated = tmp_path / "colocated"
        assert _run(_cmd(*LAYOUTS["grpo_tp2"][:1], tiny_llama_dir, colocated, LAYOUTS["grpo_tp2"][1])).rc == 0
    pooled, ref = _metrics(chain["ref"]), _metrics(colocated)
    assert len(pooled) == len(ref) == STEPS
    for a, b in zip(ref, pooled):
        keys = {k for k in a if not k.startswith(POOLED)}
        assert keys == {k for k in b if not k.startswith((*POOLED, "val/"))} and "rollout/logprob_mismatch_max" in keys
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, f"step {a['step']}"
        assert {"pool/train/busy_s", "pool/train/wait_s", "pool/rollout/busy_s", "pool/rollout/wait_s"} <= b.keys()


@pytest.mark.parametrize("chain", ["grpo_pools"], indirect=True)
def test_placement_really_happened(chain):
    """No train rank imported vLLM, no rollout rank built Megatron's groups or a model (what each rank built, as it
    recorded it in placement.json); the rollout pool's busy time covers its generation."""
    ranks = json.loads((chain["ref"] / "placement.json").read_text())
    assert [(r["rank"], r["pool"]) for r in ranks] == [(0, "train"), (1, "train"), (2, "rollout"), (3, "rollout")]
    for r in ranks[:2]:
        assert r["megatron_models"] == ["actor"] and r["megatron_initialized"], r
        assert not r["vllm_engine"] and not r["vllm_imported"], r
    for r in ranks[2:]:
        assert r["vllm_engine"] and r["megatron_models"] == [] and not r["megatron_initialized"], r
    assert len({r["pid"] for r in ranks}) == 4
    for row in _metrics(chain["ref"]):
        assert row["pool/rollout/busy_s"] >= row["timing/generate"] > 0, row
        assert row["pool/train/busy_s"] >= row["timing/update_actor"] > 0, row


@pytest.mark.parametrize("chain", ["grpo_pools"], indirect=True)
def test_the_cross_pool_sync_moves_the_planners_lower_bound(chain, tiny_llama_dir):
    """Every sync (verified by hash, as every sync) moves exactly ``rank_min`` bytes for this placement (one node:
    every weight crosses from the train ranks to the engine ranks once, each piece to the rank that holds it), and
    the engine's samples score the same under the actor (fp32)."""
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.parallel.layout import ParallelLayout
    from megarl.reshard.layout import megatron_layout, vllm_layout
    from megarl.reshard.plan import theoretical_minimum

    spec = spec_from_hf_config(read_hf_config(tiny_llama_dir))
    src, dst = megatron_layout(spec, ParallelLayout(tp=2), 4), vllm_layout(spec, 2, 2, 4).shifted(2)
    bounds = theoretical_minimum(src, dst, 4)
    assert bounds["node_min"] == 0  # one node
    for row in _metrics(chain["ref"]):
        assert row["sync/bytes_sent"] == bounds["rank_min"] > 0, (row["sync/bytes_sent"], bounds)
        assert row["rollout/logprob_mismatch_max"] < 1e-4, row


@pytest.mark.parametrize("chain", _chains(["grpo_async", "bf16_async"]), indirect=True)
def test_one_step_off_lags_one_update_and_resumes_with_the_batch_in_flight(chain):
    """configs/tiny_grpo_async.yaml: every token of step 1 is of version 0 (lag 0), every later step's of the version
    one update before the trainer's (lag exactly 1); a checkpoint holds the next step's batch, generated by the
    version before it; the run killed from outside at a random moment resumed from it (metrics and weights: the
    tests above)."""
    rows = _metrics(chain["ref"])
    assert [(r["async/lag_mean"], r["async/lag_max"]) for r in rows] == [(0.0, 0.0)] + [(1.0, 1.0)] * (STEPS - 1)
    assert [r["rollout/weight_version_max"] for r in rows] == [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert "async/logprob_mismatch_lag0" in rows[0] and all("async/logprob_mismatch_lag1plus" in r for r in rows[1:])
    held = torch.load(chain["ref"] / "checkpoints" / "iter_0000004" / "rollout_batch.pt", weights_only=False)
    assert held["step"] == 5 and len(held["batch"]["samples"]) == 4 * 8
    assert {v for s in held["batch"]["samples"] for v in s["weight_versions"]} == {3}
    assert len(held["batch"]["rewards"]) == 32 and held["batch"]["prompts"]
    assert not (chain["ref"] / "checkpoints" / "iter_0000006" / "rollout_batch.pt").exists()  # nothing after the last
    _killed_from_outside_then_resumed(chain)


@pytest.mark.parametrize("chain", _chains(["grpo_async", "bf16_async"]), indirect=True)
def test_one_step_off_generates_the_next_batch_while_the_train_pool_learns(chain):
    """The rollout pool's span generating batch k+1 overlaps the train pool's span learning from batch k, for every
    step k >= 2 (recorded ``time.monotonic`` spans, one clock on this machine; not a timing assertion)."""
    rows = [json.loads(line) for line in open(chain["ref"] / "timeline.jsonl")]
    learn = {r["step"]: (r["start"], r["end"]) for r in rows if r["phase"] == "learn"}
    generate = {r["batch"]: (r["start"], r["end"], r["step"]) for r in rows if r["phase"] == "generate"}
    assert sorted(learn) == list(range(1, STEPS + 1)) and sorted(generate) == list(range(1, STEPS + 1))
    for k in range(2, STEPS):
        (l0, l1), (g0, g1, during) = learn[k], generate[k + 1]
        assert during == k and max(l0, g0) < min(l1, g1), (k, learn[k], generate[k + 1])


def _killed_from_outside_then_resumed(chain) -> None:
    """`megarl train` was SIGKILLed mid-run (after step 3 started), the next run resumed from a checkpoint of step 2
    to 4 (and, after a stop, the run after it), and the last run completed."""
    runs = chain["runs"]
    launcher, after, last = runs["launcher"], runs.get("sigterm", runs["last"]), runs["last"]
    assert launcher.rc is None and "[megarl] step 3/6" in launcher.out, launcher.out[-3000:]
    assert re.search(r"resuming from .*iter_000000[2-4] \(step [2-4];", after.out), after.out[-3000:]
    assert last.rc == 0 and "resuming from" in last.out, _failure(last.out)


def _failure(out: str) -> str:
    """A failed run's output for an assertion message: the raised exceptions' lines first (a rank's traceback, and
    whatever vLLM dumps before it, can be longer than the message shows), then the first traceback, then the end."""
    raised = [line for line in out.splitlines() if re.search(r"\w(Error|Exception)(: |$)", line)]
    failed_at = out.find("Traceback")  # a rank's traceback comes before torchrun's report of the failure
    return "\n".join(dict.fromkeys(raised)) + "\n" + out[max(failed_at, 0):][:6000] + out[-2000:]


def _trained(out_dir) -> dict[int, list[tuple[int, str]]]:
    """Step -> the (prompt serial, prompt) of each sample it trained on (``trainer.save_samples``)."""
    files = sorted((out_dir / "samples").glob("step_*.jsonl"))
    return {int(f.stem.split("_")[1]): [(r["prompt_index"], r["prompt"]) for r in map(json.loads, open(f))]
            for f in files}  # fmt: skip


@pytest.mark.parametrize("chain", _chains(BOUNDED), indirect=True)
def test_bounded_keeps_every_token_within_the_bound_and_trains_each_prompt_once_across_a_kill(chain):
    """configs/tiny_grpo_bounded.yaml (max_staleness 2, partial rollout): no token trained at step t comes from a
    version older than t-1-2 (the largest lag over the step's tokens), and the rollout pool did run ahead (lags > 0).
    Killed from outside at a random moment and resumed: the prompts trained are exactly the data stream's first
    6 x 4 in order, each prompt's 8 samples once, the same prompts as the uninterrupted run's (nothing is in flight at
    the end: admission stops at the run's last prompt)."""
    _killed_from_outside_then_resumed(chain)  # first: a failed run's output
    for out in (chain["ref"], chain["cut"]):
        rows = _metrics(out)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert all(r["async/lag_max"] <= 2 for r in rows), [r["async/lag_max"] for r in rows]
        assert rows[0]["async/lag_max"] == 0
    assert max(r["async/lag_max"] for r in _metrics(chain["ref"])) >= 1  # generated ahead of the trainer
    if chain["name"] == "grpo_bounded":  # tool episodes: one call each, also those a resume continued from their
        for out in (chain["ref"], chain["cut"]):  # environment's state_dict
            assert all(r["env/tool_calls"] == 32 and r["env/errors"] == 0 for r in _metrics(out))
        assert sum(r["env/resumed"] for r in _metrics(chain["cut"])) > 0
    ref, cut = _trained(chain["ref"]), _trained(chain["cut"])
    assert sorted(cut) == list(range(1, STEPS + 1)) and cut.keys() == ref.keys()
    for step in range(1, STEPS + 1):
        serials = [i for i, _ in cut[step]]
        assert serials == sorted(serials) and sorted(set(serials)) == list(range((step - 1) * 4, step * 4))
        assert all(serials.count(i) == 8 for i in set(serials))
        assert cut[step] == ref[step]  # the same prompts, in the same order: the data stream's
    if "sigterm" in chain["runs"]:  # step 5 dropped (step 4 saved with the stream), or finished and saved
        stop = chain["runs"]["sigterm"]
        assert stop.rc == EXIT_PREEMPTED, stop.out[-4000:]
        cut, after = "during step 5's rollout: it is dropped; saved step 4", "stopped by SIGTERM after step 5; saved"
        assert cut in stop.out or after in stop.out, stop.out[-3000:]
        assert _stop_seconds(stop.out) < 25
    held = torch.load(chain["ref"] / "checkpoints" / "iter_0000004" / "rollout_stream.pt", weights_only=False)
    assert held["step"] == 4 and 16 <= held["cursor"] <= 24  # admitted ahead, within the bound of version <= 4
    ahead = sorted({r["serial"] for r in held["requests"]} | set(held["scored"]))
    assert ahead == list(range(16, held["cursor"])), ahead


@pytest.mark.parametrize("chain", ["grpo_bounded"], indirect=True)
def test_a_resume_with_a_tighter_bound_generates_the_samples_too_old_for_it_again(chain, tiny_llama_dir, tmp_path):
    """The uninterrupted run's step-2 checkpoint (prompts admitted up to the bound of 2, some finished, some partial)
    resumed with max_staleness=0: every group or partial sample with a token older than its batch now allows is
    dropped and its prompt generated again (said in one line), so every token trained is of the trainer's version;
    the prompts trained stay the data stream's, in order."""
    start = chain["ref"] / "checkpoints" / "iter_0000002"
    held = torch.load(start / "rollout_stream.pt", weights_only=False)
    recipe, extra = LAYOUTS["grpo_bounded"]
    run = _run(_cmd(recipe, tiny_llama_dir, tmp_path / "tight", [*extra, f"trainer.resume={start}",
                                                                  "async_training.max_staleness=0"]))  # fmt: skip
    assert run.rc == 0, run.out[-3000:]
    said = re.search(r"resumed the rollout stream at prompt (\d+): (\d+) finished group\(s\) kept, (\d+) partial "
                     r"sample\(s\) continued, (\d+) prompt\(s\) generated again", run.out)  # fmt: skip
    assert said and int(said[1]) == held["cursor"] and int(said[4]) > 0, run.out[-3000:]
    rows = _metrics(tmp_path / "tight")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["async/lag_max"] == 0 for r in rows if r["step"] > 2), [r["async/lag_max"] for r in rows]
    assert {s: p for s, p in _trained(tmp_path / "tight").items() if s > 2} == {
        s: p for s, p in _trained(chain["ref"]).items() if s > 2}
    other = _run(_cmd(recipe, tiny_llama_dir, tmp_path / "other", [f"trainer.resume={start}",
                                                                    "async_training.mode=one_step_off"]))  # fmt: skip
    assert other.rc not in (0, None) and "holds a bounded run's rollout stream and this run's async_training.mode is " \
        "one_step_off: prompts in flight do not carry across modes" in other.out, other.out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, lags", [("configs/tiny_grpo_async.yaml", {1.0}), ("configs/tiny_grpo_bounded.yaml",
                                                                                   {0.0, 1.0, 2.0})])  # fmt: skip
def test_asynchronous_quickstart_learns(tmp_path, recipe, lags):
    """`make demo`'s task (200 steps) one-step-off and bounded (~45 s each here): last-10 mean reward >= first-10 +
    0.3, the demo's criterion; one-step-off: every step after the first one update off-policy; bounded: at most 2."""
    model = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, "-m", "megarl.cli", "tiny-model", "--out", str(model)], check=True, cwd=REPO)
    cmd = [sys.executable, "-m", "megarl.cli", "train", recipe, f"model.path={model}",
           f"trainer.output_dir={tmp_path / 'run'}", "trainer.val_every=0", "logging.wandb.mode=disabled",
           "logging.progress_bar=false"]  # fmt: skip
    run = _run(cmd)
    assert run.rc == 0, run.out[-3000:]
    rows = _metrics(tmp_path / "run")
    reward = [r["reward/mean"] for r in rows]
    assert len(reward) == 200 and sum(reward[-10:]) / 10 >= sum(reward[:10]) / 10 + 0.3, (reward[:10], reward[-10:])
    assert rows[0]["async/lag_max"] == 0.0 and {r["async/lag_max"] for r in rows[1:]} <= lags
