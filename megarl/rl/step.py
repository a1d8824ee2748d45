"""One RL step, the same in every mode: the feed's batch -> rewards -> old / reference log-probs and values ->
advantages -> the critic's and the actor's updates -> the weight push -> metrics. Every rank runs it on the same
global batch; each phase is timed.

    batch = feed.batch(step)          Synchronous: generated and scored now; OneStepOff: generated during the last
                                      step; Bounded: streamed, handed over once its groups are scored
    feed.overlap(step)                OneStepOff: the rollout pool generates step + 1's batch meanwhile
    learned = learn(batch)            on the ranks that learn (``job.learns``), through the roles
    feed.push(step)                   the engines take the new weights (Bounded: every sync_every steps)

With resource pools (``placement.pools``) each rank does the phases of the roles its pool hosts: the rollout pool
samples the prompts, generates and scores; the batch (and the sampler's position) crosses to the actor's pool, which
learns; the weights cross back through the resharding engine. Colocated, every rank does every phase and nothing
crosses (``Placement.share`` hands values through unchanged)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megarl import faults
from megarl.algos import rollout_is_weights
from megarl.backend.batch import PackStats, Sequence
from megarl.env.episodes import scored
from megarl.logging.jsonl import SAMPLES_DIR, TIMELINE_FILE, write_rows
from megarl.rewards.parallel import score_on_ranks
from megarl.rewards.scorer import stop_if_broken
from megarl.rl.collect import Collected, combine_rewards, combined_scores, generate, sequences_of
from megarl.rl.estimate import advantages, pad_rows, unpad_rows
from megarl.rl.metrics import rank_values, reduce_ranks, step_metrics, validation_metrics
from megarl.rl.roles import Roles
from megarl.rl.state import TrainerState
from megarl.rl.timer import PhaseTimer

if TYPE_CHECKING:
    from megarl.run.job import Job



class StepAbandoned(Exception):  # noqa: N818 -- a decision, not an error
    """Raised on every rank at the same point once they agreed to stop mid-step: ``where`` names what was cut."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


def rl_step(job: Job, state: TrainerState, step: int, *, poison_loss: bool = False) -> dict[str, float]:
    """One RL step; afterwards the engine holds weight version ``step`` (bounded: every ``sync_every`` steps). With
    pools, ``pool/<name>/busy_s`` is the time each pool spent on its own phases and ``wait_s`` the time it waited for
    the others (the sync aside). ``poison_loss``: make the actor's loss NaN (fault injection)."""
    timer, pool_time, feed = PhaseTimer(), PhaseTimer(), job.feed
    learned = learn_span = None
    started = time.monotonic()
    with timer("step"):
        batch = feed.batch(step, pool_time)
        if batch.stopped:  # on every rank alike (the batch is shared)
            raise StepAbandoned("rollout")
        check_rewards(job, batch, step)
        feed.overlap(step, pool_time)
        if job.learns:
            learned, learn_span = learn_step(job, batch, step, timer, pool_time, poison_loss)
        report = feed.push(step, timer)
    spans = feed.rollout_spans(batch, timer)
    if learn_span is not None and job.place.pooled and job.place.leader:
        record_timeline(job, step, started, [{"pool": job.place.pool.name, **learn_span}, *spans])
    advance(job, state, step, feed.skipped(learned))
    return step_report(job, state, batch, learned, report, timer, pool_time, step)


def check_rewards(job: Job, batch: Collected, step: int) -> None:
    """The step's samples kept (``trainer.save_samples``); a reward that fails too often stops the run, the first
    failure is said once."""
    if job.cfg.trainer.save_samples and job.place.leader:
        save_samples(job, batch, step)
    stop_if_broken(job.cfg.reward, batch.errors, batch.scored, batch.first_error, f"in step {step}")
    env_error = next((s.env_error for s in batch.samples if s.env_error), None)
    if env_error and not job.said_env_error:
        job.say(f"an environment failed on some episodes; they score 0 (counted in env/errors, timeouts also in "
                f"env/timeouts). The first failure: {env_error}")  # fmt: skip
        job.said_env_error = True
    if batch.first_error and not job.said_reward_error:
        job.say(
            "the reward function failed on some samples; they score 0 (counted in reward/errors, timeouts also "
            f"in reward/timeouts). The first failure: {batch.first_error}"
        )
        job.said_reward_error = True


def learn_step(job: Job, batch: Collected, step: int, timer: PhaseTimer, pool_time: PhaseTimer, poison_loss: bool):
    """Collective over the learners: the reward model's scores (if one), then ``learn``; what it learned and its span
    (the timeline)."""
    faults.fire("sigterm_update", step)
    start = time.monotonic()
    job.phases.train()
    if job.roles.reward_model is not None:
        with timer("reward_model"):
            combine_rewards(job.cfg.reward, batch, job.roles.reward_model.scores(sequences_of(batch.samples)))
    learned = learn(job.cfg, job.roles, batch, kl_ctrl=job.kl_ctrl, skip_old_logprob=job.skip_old_logprob,
                    timer=timer, poison_loss=poison_loss)  # fmt: skip
    pool_time.seconds["busy"] += job.roles.busy_s()
    return learned, {"phase": "learn", "batch": step, "start": start, "end": time.monotonic()}


def advance(job: Job, state: TrainerState, step: int, skipped: list[str]) -> None:
    """The trainer state after step ``step``; a step whose update was skipped is counted, and too many in a row stop
    the run."""
    state.step = step
    state.data = job.sampler.state_dict()
    state.kl_ctrl = job.kl_ctrl.state_dict()
    if not skipped:
        state.consecutive_skips = 0
        return
    state.skipped_steps += 1
    state.consecutive_skips += 1
    job.say(f"step {step}: update skipped ({'; '.join(skipped)}); weights and optimizer unchanged")
    if state.consecutive_skips >= job.cfg.trainer.max_consecutive_skips:
        raise FloatingPointError(
            f"{state.consecutive_skips} consecutive RL step(s) had a non-finite loss or gradients (last: "
            f"{'; '.join(skipped)}); stopping (trainer.max_consecutive_skips="
            f"{job.cfg.trainer.max_consecutive_skips}). Lower the learning rate or check the reward function; "
            "the last checkpoint is intact"
        )


def step_report(job: Job, state: TrainerState, batch, learned, report, timer: PhaseTimer, pool_time: PhaseTimer,
                step: int) -> dict:  # fmt: skip
    """Collective: the step's metrics on every rank (the ranks' timings and memory reduced; with pools, each pool's
    busy and waiting time)."""
    place = job.place
    sums, maxes = rank_values(report)
    if place.pooled:
        busy = pool_time.seconds["busy"]
        wait = timer.seconds["step"] - busy - timer.seconds["sync"]
        maxes.update({f"pool/{place.pool.name}/busy_s": busy, f"pool/{place.pool.name}/wait_s": wait})
    metrics = step_metrics(job, batch, learned, timer=timer, version=step - 1) if job.learns else {}
    job.feed.pool_metrics(batch, maxes)
    metrics.update(reduce_ranks(job.feed.metrics_comm(), sums, maxes))
    metrics["train/skipped_steps"] = float(state.skipped_steps)
    return metrics


def record_timeline(job: Job, step: int, started: float, spans: list[dict]) -> None:
    """The leader: the step's spans (``time.monotonic``, one clock per machine) in output_dir/timeline.jsonl."""
    rows = [{"step": step, "step_start": started, **span} for span in spans]
    with open(os.path.join(job.cfg.trainer.output_dir, TIMELINE_FILE), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


VAL_SAMPLES_SHOWN = 3
"""Validation prompts printed with their completions before training (step 0) and after the last step."""


def keep_validation_samples(job: Job, step: int, samples, scores) -> None:
    """Step ``step``'s validation completions as output_dir/samples/val_step_<N>.jsonl (prompt, response, answer,
    score, and the token ids of prompt and response); the first ``VAL_SAMPLES_SHOWN`` printed at step 0 and at the
    last step."""
    prompts = job.val_prompts
    rows = [
        {"prompt_index": s.prompt_index, "prompt": prompts[s.prompt_index].prompt_text,
         "response": job.tokenizer.decode(s.token_ids, skip_special_tokens=True),
         "answer": prompts[s.prompt_index].ground_truth, "score": score,
         "prompt_ids": list(prompts[s.prompt_index].prompt_ids), "response_ids": list(s.token_ids)}
        for s, score in zip(samples, scores)
    ]  # fmt: skip
    write_rows(os.path.join(job.cfg.trainer.output_dir, SAMPLES_DIR, f"val_step_{step:07d}.jsonl"), rows)
    if step in (0, job.cfg.trainer.total_steps):
        shown = sorted(rows, key=lambda r: r["prompt_index"])[:VAL_SAMPLES_SHOWN]
        for r in shown:
            prompt = " ".join(r["prompt"].split())[-90:]
            job.say(f"step {step} validation: ...{prompt!r} -> {r['response']!r} (answer {r['answer']}, score "
                    f"{r['score']:g})")  # fmt: skip


def save_samples(job: Job, batch, step: int) -> None:
    """``trainer.save_samples``: the step's samples as output_dir/samples/step_<N>.jsonl."""
    rows = [
        {
            "prompt_index": s.prompt_index,
            "prompt": batch.prompts[s.prompt_index].prompt_text,
            "response": job.tokenizer.decode(s.token_ids, skip_special_tokens=True),
            "score": score,
            "reward": reward,
            "failed": failed,
            **episode_fields(s),
        }
        for s, score, reward, failed in zip(batch.samples, batch.scores, batch.rewards, batch.failed)
    ]
    write_rows(os.path.join(job.cfg.trainer.output_dir, SAMPLES_DIR, f"step_{step:07d}.jsonl"), rows)


def episode_fields(sample) -> dict:
    """An episode's whole token sequence in a saved sample: prompt and response ids, the mask (1: the model's
    token), each token's weight version, the turns' ends and rewards, its counts and its environment's failure."""
    if sample.mask is None:
        return {}
    return {"prompt_ids": sample.prompt_ids, "response_ids": sample.token_ids, "mask": sample.mask,
            "weight_versions": sample.weight_versions, "turn_ends": sample.turn_ends,
            "turn_rewards": sample.turn_rewards, "env": sample.env, "env_error": sample.env_error}  # fmt: skip


@dataclass
class Learned:
    """What one update computed on the step's batch (global, identical on every rank)."""

    seqs: list[Sequence]
    rollout_logp: list[torch.Tensor]
    old_logp: list[torch.Tensor] | None
    ref_logp: list[torch.Tensor] | None
    values: list[torch.Tensor] | None
    returns: list[torch.Tensor] | None
    advantages: list[torch.Tensor]
    actor: dict[str, float]
    critic: dict[str, float]
    kl: dict[str, float]
    skipped: list[str]
    """Updates not applied because their loss or gradients were not finite ("actor: non-finite pg_loss")."""
    packed: PackStats = field(default_factory=PackStats)
    """The micro-batches of the step's passes (the reward model's scoring, log-probs, values, updates)."""


def learn(
    cfg, roles: Roles, batch, *, kl_ctrl, skip_old_logprob: bool, timer: PhaseTimer, poison_loss=False
) -> Learned:
    """Collective: old / reference log-probs and values, advantages, then the critic's and the actor's updates on the
    step's samples (the exact token ids the engine generated). A model's update whose loss or gradients are not
    finite is not applied (see ``ppo_updates``) and is named in ``Learned.skipped``. ``poison_loss``: make the
    actor's loss NaN (fault injection)."""
    seqs = [sequence_of(s) for s in batch.samples]
    models = ModelTokens(batch.samples)  # episodes: the model's tokens (advantages, values, metrics) among all
    rollout_logp = models.only([torch.tensor(s.logprobs, dtype=torch.float32) for s in batch.samples])
    lengths = [len(x) for x in rollout_logp]
    actor, reference, critic = roles.actor, roles.reference, roles.critic

    with timer("old_logprob"):
        old_logp = None if skip_old_logprob else models.only(actor.logprobs(seqs))
    with timer("ref"):
        ref_logp = models.only(reference.logprobs(seqs)) if reference is not None else None
    with timer("values"):
        values = models.only(critic.values(seqs)) if critic is not None else None
    with timer("advantages"):
        mask_NR = pad_rows([torch.ones(n) for n in lengths])
        adv_NR, returns_NR, kl_metrics = advantages(
            cfg.algorithm,
            torch.tensor(batch.rewards, dtype=torch.float32),
            torch.tensor([s.prompt_index for s in batch.samples]),
            mask_NR,
            behaviour_logp_NR=pad_rows(old_logp or rollout_logp),
            ref_logp_NR=pad_rows(ref_logp) if ref_logp is not None else None,
            values_NR=pad_rows(values) if values is not None else None,
            kl_ctrl=kl_ctrl,
            kl_metric_type=cfg.actor.kl_loss_type,
            token_rewards_NR=turn_credit(batch, mask_NR) if cfg.env.per_turn_credit else None,
        )
    adv = unpad_rows(adv_NR, lengths)
    if poison_loss:
        adv = [a * float("nan") for a in adv]
    returns = unpad_rows(returns_NR, lengths) if returns_NR is not None else None
    updates = {}
    with timer("update_critic"):
        if critic is not None:
            updates["critic"] = critic.update(seqs, models.spread({"old_values": values, "returns": returns}))
    with timer("update_actor"):
        trained, rejected = None, {}
        if cfg.algorithm.rollout_is == "seq_mask":  # decided on pi_old for whole sequences, before the update
            trained, rejected = seq_mask_accepted(old_logp, rollout_logp, cfg.algorithm)
        fields = {"advantages": adv, "rollout_logp": rollout_logp}
        if old_logp is not None:
            fields["old_logp"] = old_logp
        if cfg.actor.kl_loss_coef > 0:
            fields["ref_logp"] = ref_logp
        updates["actor"] = actor.update(seqs, models.spread(fields), trained=trained)
        if updates["actor"].skipped is None:
            updates["actor"].metrics.update(rejected)
    skipped = [f"{name}: {u.skipped}" for name, u in updates.items() if u.skipped is not None]
    critic_metrics = updates["critic"].metrics if "critic" in updates else {}
    return Learned(
        seqs, rollout_logp, old_logp, ref_logp, values, returns, adv, updates["actor"].metrics, critic_metrics,
        kl_metrics, skipped, roles.packed(),
    )  # fmt: skip


def sequence_of(sample) -> Sequence:
    """The training sequence of a sample: its exact token ids; an episode's observation tokens out of the loss."""
    mask = tuple(sample.mask) if sample.mask is not None else None
    return Sequence(sample.prompt_ids + sample.token_ids, len(sample.prompt_ids), mask, sample.routed_experts)


class ModelTokens:
    """Where the model's tokens are among a batch's response tokens (all of them but in episodes, whose observation
    tokens are no action): advantages, values and the log-prob metrics are over the model's tokens alone, as if
    each episode's turns were one response; the update's fields go back to every response token (0 on an
    observation's, which the loss mask leaves out)."""

    def __init__(self, samples):
        self.keep = [torch.tensor(s.mask, dtype=torch.bool) if s.mask is not None else None for s in samples]

    def only(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Response-aligned rows -> the model tokens' values."""
        return [r if k is None else r[k] for r, k in zip(rows, self.keep)]

    def spread(self, fields: dict) -> dict:
        """Model-token rows (``only``'s) -> response-aligned rows, 0 on observation tokens; None stays None."""

        def back(r, k):
            if k is None:
                return r
            out = torch.zeros(len(k), dtype=r.dtype)
            out[k] = r
            return out

        return {name: None if rows is None else [back(r, k) for r, k in zip(rows, self.keep)]
                for name, rows in fields.items()}  # fmt: skip


def turn_credit(batch, mask_NR: torch.Tensor) -> torch.Tensor:
    """``env.per_turn_credit``: rewards per model token, each turn's environment reward at that turn's last model
    token and the rest of the episode's reward (the reward function's, shaping) at its last one."""
    out = torch.zeros_like(mask_NR)
    for i, s in enumerate(batch.samples):
        n = int(mask_NR[i].sum())
        rest = batch.rewards[i]
        if s.turn_ends is not None:
            position = torch.cumsum(torch.tensor(s.model_mask), 0) - 1  # token index -> its model-token index
            for end, r in zip(s.turn_ends, s.turn_rewards or []):
                out[i, int(position[end])] += r
                rest -= r
        out[i, n - 1] += rest
    return out


def seq_mask_accepted(old_logp: list[torch.Tensor], rollout_logp: list[torch.Tensor], algo):
    """``rollout_is=seq_mask``: which sequences stay in the actor's loss (their pi_old / pi_rollout statistic at
    ``algo.rollout_is_level`` within [1/cap, cap]; the loss weighs each by it) and the rejection metrics."""
    mask_NR = pad_rows([torch.ones(len(x)) for x in old_logp])
    weights = rollout_is_weights(pad_rows(old_logp), pad_rows(rollout_logp), mask_NR, "seq_mask",
                                 algo.rollout_is_cap, algo.rollout_is_level)  # fmt: skip
    accepted = (weights["weights"][:, 0] > 0).tolist()
    metrics = {
        "rollout/is_masked_frac": float(weights["masked"].sum() / mask_NR.sum().clamp(min=1)),
        "rollout/is_rejected_seqs": 1.0 - sum(accepted) / max(len(accepted), 1),
    }
    return accepted, metrics


def validate(job: Job, step: int) -> dict[str, float] | None:
    """Collective: one sample per validation prompt with ``rollout.val_sampling``, scored (on the rollout's pool, and
    by the reward model, combined as in training); ``val/*`` metrics on every rank. None when a stop request cut it
    (agreed on the rollout's pool, then shared)."""
    prompts = job.val_prompts
    cut = job.stop.agreed_here if job.stop is not None else lambda: False

    def on_rollout_pool():
        samples, _ = generate(job.engine, prompts, step=step, sampling=job.cfg.rollout.val_sampling,
                              seed=job.cfg.trainer.seed, episodes=job.episodes, stop=cut)  # fmt: skip
        if cut():
            return None
        result = score_on_ranks(
            job.rewards,
            [p.prompt_text for p in prompts],
            [job.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples],
            [p.ground_truth for p in prompts],
            [p.extras for p in prompts],
        )
        if job.episodes is not None:
            result = scored(samples, result)
        return None if cut() else (samples, result)

    done = job.feed.validation(step, on_rollout_pool)  # bounded: beside the training requests, this step's weights
    if done is None:
        return None
    samples, result = done
    stop_if_broken(job.cfg.reward, result.errors, len(samples), result.first_error, f"in step {step}'s validation")
    if job.roles.reward_model is not None and job.learns:  # one-step-off: the rollout pool needs no val/ metric
        job.phases.train()  # the reward model's weights back on the device
        rm = job.roles.reward_model.scores(sequences_of(samples))
        job.roles.packed()  # validation is not a training pass: its micro-batches stay out of the next step's
        if not job.place.pooled:  # resyncs only if the engine freed its weights while asleep (GPU, colocated)
            job.phases.rollout(step)
        result.scores = combined_scores(job.cfg.reward, result.scores, rm, samples)
    if job.place.leader:
        keep_validation_samples(job, step, samples, result.scores)  # the scores val/reward/mean averages
    return validation_metrics(result, samples)
