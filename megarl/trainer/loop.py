"""The RL loop: rollout -> rewards -> reference / old log-probs / values -> advantages -> critic and actor updates ->
weight sync -> metrics. Every rank runs the same code on the same global batch; each phase is timed.

With resource pools (``placement.pools``) each rank does the phases of the roles its pool hosts: the rollout pool
samples the prompts, generates and scores; the batch (and the sampler's position) crosses to the actor's pool, which
learns; the weights cross back through the resharding engine. Colocated, every rank does every phase and nothing
crosses (``Placement.share`` hands values through unchanged)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from functools import partial

import torch

from megarl.algos import rollout_is_weights
from megarl.checkpoint.format import atomic_write
from megarl.checkpoint.training import checkpoints_root, save_training
from megarl.logging.jsonl import write_rows
from megarl.reshard.sync import push_actor
from megarl.rewards.parallel import score_on_ranks
from megarl.rewards.scorer import stop_if_broken
from megarl.rollout.protocol import rollout
from megarl.trainer import faults
from megarl.trainer.advantage import advantages, pad_rows, unpad_rows
from megarl.trainer.collect import collect
from megarl.trainer.job import Job, build_job, describe_checkpoint_root, lora_identity
from megarl.trainer.metrics import rank_values, reduce_ranks, step_metrics, summary_lines, validation_metrics
from megarl.trainer.models import RLModels, reference_policy
from megarl.trainer.preemption import StopRequests
from megarl.trainer.resume import SAMPLES_DIR, STOPPED_FILE
from megarl.trainer.state import TrainerState
from megarl.trainer.timer import PhaseTimer
from megarl.training.batch import Sequence
from megarl.training.logprobs import logprobs_from_logits
from megarl.training.losses import actor_loss, critic_loss, critic_values
from megarl.training.step import NonFiniteUpdate
from megarl.training.update import forward_fields, ppo_updates


def train(cfg, spec, source, engine=None) -> Job:
    """Run RL steps up to ``trainer.total_steps`` (collective over the world), continuing a checkpoint when
    ``trainer.resume`` finds one; returns the job (its engine can serve another job of the same model and layout).
    A SIGTERM/SIGUSR1 stops it at the next step boundary, after a save; ``job.stopped_by`` then names the signal."""
    job, state = build_job(cfg, spec, source, engine=engine)
    t = cfg.trainer
    rewards = job.rewards if job.rewards is not None else contextlib.nullcontext()
    with rewards, job.tracker, StopRequests() as stop:  # the reward's workers end with the run
        job.offloader.offload()  # the engine is awake: generation comes first
        for step in range(state.step + 1, t.total_steps + 1):
            metrics = rl_step(job, state, step)
            if t.val_every and job.val_prompts and (step % t.val_every == 0 or step == t.total_steps):
                metrics.update(validate(job, step))
            job.tracker.log(step, metrics)
            state.history.append({"step": step, **metrics})
            stopping = stop.agreed(job.place)
            last = step == t.total_steps
            if stopping or (t.save_every and (step % t.save_every == 0 or last)):
                save(job, state)
            by = stop.signal_name or "a signal on another rank"
            if stopping and last:  # nothing left to resume: a complete run
                job.say(f"{by} during the last step: saved; the run is complete")
            elif stopping:
                job.stopped_by = by
                if job.place.leader:
                    atomic_write(
                        os.path.join(t.output_dir, STOPPED_FILE), f"step {step}: stopped by {job.stopped_by}\n"
                    )
                job.say(f"stopped by {job.stopped_by} after step {step}; saved; resume with the same command")
                break
        else:
            job.tracker.finish(summary_lines(state.history))
    job.offloader.reload()  # the models are whole again for whoever holds the job
    return job


def save(job: Job, state: TrainerState) -> dict:
    """Collective over the actor's pool: a training checkpoint of this step under ``output_dir/checkpoints`` (the
    rollout pool saves nothing: the sampler's position crossed with the batch and is in the trainer state)."""
    if job.models is None:
        return {}
    root = checkpoints_root(job.cfg.trainer.output_dir)
    if job.place.leader:
        describe_checkpoint_root(job, root)
    if job.offloader.enabled:  # the optimizer state is on the host: bring it back, with the engine asleep
        switch_to(job, TRAIN)
    report = save_training(
        root,
        state.step,
        job.models,
        {"state": state.to_dict(), "layout": dataclasses.asdict(job.layout), "world_size": job.layout.world_size,
         "lora_base": job.lora_base, "lora": lora_identity(job.cfg.actor.lora)},  # fmt: skip
        keep_last=job.cfg.trainer.keep_last,
        before_manifest=lambda: faults.fire("save", state.step),
    )
    if job.offloader.enabled:
        back_to_rollout(job, state.step)  # re-syncs only if the engine freed its weights to make room
    job.say(
        f"saved step {state.step}: {report['path']} ({report['bytes'] / 1e6:.1f} MB, {report['seconds']:.2f}s, "
        f"hashing {report['hash_seconds']:.2f}s)"
    )
    return report


ROLLOUT, TRAIN, SYNC = "rollout", "train", "sync"


def switch_to(job: Job, phase: str) -> None:
    """The one place that moves memory between the phases (``megarl plan`` models each one).

    TRAIN: the engine sleeps (CUDA: vLLM frees its weights and KV cache; HF: its model is freed; vLLM on CPU: a
    logged no-op) and the offloaded training state comes back. SYNC: the training state the ``offload.*`` flags
    name goes to host memory (the sync itself wakes the engine's weights). ROLLOUT: the same, and the engine wakes
    for generation. A step starts and ends in the rollout phase."""
    if phase == TRAIN:
        job.engine.sleep()
        job.offloader.reload()
    else:
        job.offloader.offload()
        if phase == ROLLOUT:
            job.engine.wake()


def back_to_rollout(job: Job, version: int):
    """From training to generation: offload, load the actor's weights as ``version`` into the engine unless it
    already holds them (the sync report, else None), wake the engine."""
    switch_to(job, SYNC)
    report = None
    if job.engine.weight_version != version:
        report = push_actor(job.engine, job.models.actor if job.models is not None else None, version)
    switch_to(job, ROLLOUT)
    return report


def rl_step(job: Job, state: TrainerState, step: int) -> dict[str, float]:
    """One RL step; afterwards the engine holds weight version ``step``. With pools, ``pool/<name>/busy_s`` is the
    time each pool spent on its own phases and ``wait_s`` the time it waited for the other (the sync aside)."""
    timer, pool_time, place = PhaseTimer(), PhaseTimer(), job.place
    faults.fire("sigterm", step)
    with timer("step"):
        faults.fire("generate", step, after_s=0.05)
        batch = None
        if place.hosts("rollout"):
            with pool_time("busy"):
                batch = collect(job.cfg, job.engine, job.sampler, job.rewards, job.tokenizer, step=step, timer=timer)
        with pool_time("wait"):
            batch = share_batch(job, batch, timer)
        if job.cfg.trainer.save_samples and place.leader:
            save_samples(job, batch, step)
        stop_if_broken(job.cfg.reward, batch.errors, batch.scored, batch.first_error, f"in step {step}")
        if batch.first_error and not job.said_reward_error:
            job.say(
                "the reward function failed on some samples; they score 0 (counted in reward/errors, timeouts also "
                f"in reward/timeouts). The first failure: {batch.first_error}"
            )
            job.said_reward_error = True
        learned = None
        if place.hosts("actor"):
            with pool_time("busy"):
                switch_to(job, TRAIN)
                learned = learn(
                    job.cfg,
                    job.spec,
                    job.models,
                    batch,
                    kl_ctrl=job.kl_ctrl,
                    skip_old_logprob=job.skip_old_logprob,
                    timer=timer,
                    poison_loss=faults.at("nan_loss", step),
                )
        if place.pooled:
            with pool_time("wait"):
                place.barrier()  # the rollout pool waits here for the update
        with timer("sync"):
            report = back_to_rollout(job, step)  # the engine holds step - 1: always a sync
    state.step = step
    state.data = job.sampler.state_dict()
    state.kl_ctrl = job.kl_ctrl.state_dict()
    sums, maxes = rank_values(report)
    if place.pooled:
        maxes.update({f"pool/{place.pool.name}/{k}_s": pool_time.seconds[k] for k in ("busy", "wait")})
    per_rank = reduce_ranks(place.comm if place.pooled else None, sums, maxes)
    metrics, skipped = None, None
    if learned is not None:
        metrics = {**step_metrics(job, batch, learned, timer=timer), **per_rank}
        metrics["train/skipped_steps"] = float(state.skipped_steps + bool(learned.skipped))
        skipped = learned.skipped
    metrics, skipped = place.share((metrics, skipped), "actor")
    if skipped:
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
    else:
        state.consecutive_skips = 0
    return metrics


def share_batch(job: Job, batch, timer: PhaseTimer):
    """The rollout pool's batch on every rank, with the sampler's position and the generation timings; colocated,
    ``batch`` itself (every rank generated it)."""
    place = job.place
    if not place.pooled:
        return batch
    rollout_seconds = {k: v for k, v in timer.seconds.items() if k in ("generate", "reward")}
    batch, data, rollout_seconds = place.share((batch, job.sampler.state_dict(), rollout_seconds), "rollout")
    if not place.hosts("rollout"):
        job.sampler.load_state_dict(data)
        timer.seconds.update(rollout_seconds)
    return batch


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
        }
        for s, score, reward, failed in zip(batch.samples, batch.scores, batch.rewards, batch.failed)
    ]
    write_rows(os.path.join(job.cfg.trainer.output_dir, SAMPLES_DIR, f"step_{step:07d}.jsonl"), rows)


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


def learn(
    cfg, spec, models: RLModels, batch, *, kl_ctrl, skip_old_logprob: bool, timer: PhaseTimer, poison_loss=False
) -> Learned:
    """Collective: old / reference log-probs and values, advantages, then the critic's and the actor's updates on the
    step's samples (the exact token ids the engine generated). A model's update whose loss or gradients are not
    finite is not applied (see ``ppo_updates``) and is named in ``Learned.skipped``. ``poison_loss``: make the
    actor's loss NaN (fault injection)."""
    a, m = cfg.actor, models
    seqs = [Sequence(s.prompt_ids + s.token_ids, len(s.prompt_ids)) for s in batch.samples]
    lengths = [s.response_len for s in seqs]
    rollout_logp = [torch.tensor(s.logprobs, dtype=torch.float32) for s in batch.samples]
    forward = partial(
        forward_fields,
        seqs=seqs,
        global_batch_size=a.global_batch_size,
        max_tokens=a.max_tokens_per_micro_batch,
        micro_batch_size=a.micro_batch_size,
    )
    temperature = cfg.rollout.sampling.temperature
    logp_fn = lambda mb, logits: logprobs_from_logits(logits, mb["targets"], temperature, spec.vocab_size)

    with timer("old_logprob"):
        old_logp = None if skip_old_logprob else forward(m.actor, per_token=logp_fn)
    with timer("ref"), reference_policy(m) as reference:
        ref_logp = forward(reference, per_token=logp_fn) if reference is not None else None
    with timer("values"):
        values = None
        if m.critic is not None:
            c = cfg.critic
            values = forward(
                m.critic,
                per_token=critic_values,
                max_tokens=c.max_tokens_per_micro_batch,
                micro_batch_size=c.micro_batch_size,
            )
    with timer("advantages"):
        adv_NR, returns_NR, kl_metrics = advantages(
            cfg.algorithm,
            torch.tensor(batch.rewards, dtype=torch.float32),
            torch.tensor([s.prompt_index for s in batch.samples]),
            pad_rows([torch.ones(n) for n in lengths]),
            behaviour_logp_NR=pad_rows(old_logp or rollout_logp),
            ref_logp_NR=pad_rows(ref_logp) if ref_logp is not None else None,
            values_NR=pad_rows(values) if values is not None else None,
            kl_ctrl=kl_ctrl,
            kl_metric_type=a.kl_loss_type,
        )
    adv = unpad_rows(adv_NR, lengths)
    if poison_loss:
        adv = [a * float("nan") for a in adv]
    skipped = []
    returns = unpad_rows(returns_NR, lengths) if returns_NR is not None else None
    norm_len = a.loss_agg_norm_len or cfg.rollout.sampling.max_new_tokens
    critic_metrics = {}
    with timer("update_critic"):
        if m.critic is not None:
            c = cfg.critic
            critic_metrics = _applied(
                "critic",
                skipped,
                ppo_updates,
                m.critic,
                m.critic_optim,
                seqs,
                {"old_values": values, "returns": returns},
                partial(critic_loss, c),
                global_batch_size=a.global_batch_size,
                epochs=c.ppo_epochs,
                max_tokens=c.max_tokens_per_micro_batch,
                micro_batch_size=c.micro_batch_size,
                norm_len=norm_len,
                scheduler=m.critic_sched,
            )
    with timer("update_actor"):
        trained, rejected = None, {}
        if cfg.algorithm.rollout_is == "seq_mask":  # decided on pi_old for whole sequences, before the update
            trained, rejected = seq_mask_accepted(old_logp, rollout_logp, cfg.algorithm.rollout_is_cap)
        fields = {"advantages": adv, "rollout_logp": rollout_logp}
        if old_logp is not None:
            fields["old_logp"] = old_logp
        if a.kl_loss_coef > 0:
            fields["ref_logp"] = ref_logp
        actor_metrics = _applied(
            "actor",
            skipped,
            ppo_updates,
            m.actor,
            m.actor_optim,
            seqs,
            fields,
            partial(actor_loss, a, cfg.algorithm, temperature=temperature, true_vocab=spec.vocab_size),
            global_batch_size=a.global_batch_size,
            epochs=a.ppo_epochs,
            max_tokens=a.max_tokens_per_micro_batch,
            micro_batch_size=a.micro_batch_size,
            norm_len=norm_len,
            scheduler=m.actor_sched,
            trained=trained,
        )
        if actor_metrics:  # not skipped
            actor_metrics.update(rejected)
    return Learned(
        seqs,
        rollout_logp,
        old_logp,
        ref_logp,
        values,
        returns,
        adv,
        actor_metrics,
        critic_metrics,
        kl_metrics,
        skipped,
    )


def seq_mask_accepted(old_logp: list[torch.Tensor], rollout_logp: list[torch.Tensor], cap: float):
    """``rollout_is=seq_mask``: which sequences stay in the actor's loss (pi_old / pi_rollout over the whole
    response within [1/cap, cap]) and the rejection metrics."""
    mask_NR = pad_rows([torch.ones(len(x)) for x in old_logp])
    weights = rollout_is_weights(pad_rows(old_logp), pad_rows(rollout_logp), mask_NR, "seq_mask", cap)
    accepted = (weights["weights"][:, 0] > 0).tolist()
    metrics = {
        "rollout/is_masked_frac": float(weights["masked"].sum() / mask_NR.sum().clamp(min=1)),
        "rollout/is_rejected_seqs": 1.0 - sum(accepted) / max(len(accepted), 1),
    }
    return accepted, metrics


def _applied(name: str, skipped: list[str], update, *args, **kwargs) -> dict[str, float]:
    """``update(*args, **kwargs)``'s metrics, or {} (and a note in ``skipped``) when it was not finite."""
    try:
        return update(*args, **kwargs)
    except NonFiniteUpdate as e:
        skipped.append(f"{name}: {e}")
        return {}


def validate(job: Job, step: int) -> dict[str, float]:
    """Collective: one sample per validation prompt with ``rollout.val_sampling``, scored (on the rollout's pool);
    ``val/*`` metrics on every rank."""
    metrics = None
    if job.place.hosts("rollout"):
        prompts = job.val_prompts
        samples, _ = rollout(
            job.engine,
            [p.prompt_ids for p in prompts],
            step=step,
            sampling=job.cfg.rollout.val_sampling,
            seed=job.cfg.trainer.seed,
        )
        result = score_on_ranks(
            job.rewards,
            [p.prompt_text for p in prompts],
            [job.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples],
            [p.ground_truth for p in prompts],
            [p.extras for p in prompts],
        )
        where = f"in step {step}'s validation"
        stop_if_broken(job.cfg.reward, result.errors, len(samples), result.first_error, where)
        metrics = validation_metrics(result, samples)
    return job.place.share(metrics, "rollout")
