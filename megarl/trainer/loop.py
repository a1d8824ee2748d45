"""The RL loop: rollout -> rewards -> reference / old log-probs / values -> advantages -> critic and actor updates ->
weight sync -> metrics. Every rank runs the same code on the same global batch; each phase is timed."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from megarl.reshard.sync import actor_tensors
from megarl.rewards.parallel import score_on_ranks
from megarl.rollout.protocol import rollout
from megarl.trainer.advantage import advantages, pad_rows, unpad_rows
from megarl.trainer.collect import collect
from megarl.trainer.job import Job, build_job
from megarl.trainer.metrics import step_metrics, summary_lines, validation_metrics
from megarl.trainer.models import RLModels
from megarl.trainer.state import TrainerState
from megarl.trainer.timer import PhaseTimer
from megarl.training.batch import Sequence
from megarl.training.logprobs import logprobs_from_logits
from megarl.training.losses import actor_loss, critic_loss, critic_values
from megarl.training.update import forward_fields, ppo_updates


def train(cfg, spec, source, state: TrainerState | None = None, engine=None) -> Job:
    """Run ``trainer.total_steps`` RL steps (collective over the world); returns the job (its engine can serve
    another job of the same model and layout)."""
    state = state or TrainerState(seed=cfg.trainer.seed)
    job = build_job(cfg, spec, source, state, engine=engine)
    history = []
    with job.tracker:
        for step in range(state.step + 1, cfg.trainer.total_steps + 1):
            metrics = rl_step(job, state, step)
            if (
                cfg.trainer.val_every
                and job.val_prompts
                and (step % cfg.trainer.val_every == 0 or step == cfg.trainer.total_steps)
            ):
                metrics.update(validate(job, step))
            job.tracker.log(step, metrics)
            history.append(metrics)
        job.tracker.finish(summary_lines(history))
    return job


ROLLOUT, TRAIN = "rollout", "train"


def switch_to(job: Job, phase: str) -> None:
    """The one place that moves memory between generation and training: the engine sleeps while Megatron trains
    (CUDA: vLLM frees its weights and KV cache; HF: its model is freed; vLLM on CPU: a logged no-op) and wakes for
    generation. A step starts and ends in the rollout phase (the weight sync rewrites the engine's weights)."""
    if phase == TRAIN:
        job.engine.sleep()
    else:
        job.engine.wake()


def rl_step(job: Job, state: TrainerState, step: int) -> dict[str, float]:
    """One RL step; afterwards the engine holds weight version ``step``."""
    timer = PhaseTimer()
    with timer("step"):
        batch = collect(job.cfg, job.engine, job.sampler, job.reward_fn, job.tokenizer, step=step, timer=timer)
        if batch.first_error and not job.said_reward_error:
            job.say(
                f"the reward function raised; those samples score 0 (counted in reward/errors):\n{batch.first_error}"
            )
            job.said_reward_error = True
        switch_to(job, TRAIN)
        learned = learn(
            job.cfg,
            job.spec,
            job.models,
            batch,
            kl_ctrl=job.kl_ctrl,
            skip_old_logprob=job.skip_old_logprob,
            timer=timer,
        )
        with timer("sync"):
            report = job.engine.update_weights(actor_tensors(job.models.actor), step)
            switch_to(job, ROLLOUT)
    state.step = step
    state.data = job.sampler.state_dict()
    state.kl_ctrl = job.kl_ctrl.state_dict()
    return step_metrics(job, batch, learned, sync=report, timer=timer)


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


def learn(cfg, spec, models: RLModels, batch, *, kl_ctrl, skip_old_logprob: bool, timer: PhaseTimer) -> Learned:
    """Collective: old / reference log-probs and values, advantages, then the critic's and the actor's updates on the
    step's samples (the exact token ids the engine generated)."""
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
    with timer("ref"):
        ref_logp = forward(m.reference, per_token=logp_fn) if m.reference is not None else None
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
    returns = unpad_rows(returns_NR, lengths) if returns_NR is not None else None
    norm_len = a.loss_agg_norm_len or cfg.rollout.sampling.max_new_tokens
    critic_metrics = {}
    with timer("update_critic"):
        if m.critic is not None:
            c = cfg.critic
            critic_metrics = ppo_updates(
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
            )
    with timer("update_actor"):
        fields = {"advantages": adv, "rollout_logp": rollout_logp}
        if old_logp is not None:
            fields["old_logp"] = old_logp
        if a.kl_loss_coef > 0:
            fields["ref_logp"] = ref_logp
        actor_metrics = ppo_updates(
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
        )
    return Learned(
        seqs, rollout_logp, old_logp, ref_logp, values, returns, adv, actor_metrics, critic_metrics, kl_metrics
    )


def validate(job: Job, step: int) -> dict[str, float]:
    """Collective: one sample per validation prompt with ``rollout.val_sampling``, scored; ``val/*`` metrics."""
    prompts = job.val_prompts
    samples, _ = rollout(job.engine, [p.prompt_ids for p in prompts], step=step, sampling=job.cfg.rollout.val_sampling)
    result = score_on_ranks(
        job.reward_fn,
        [p.prompt_text for p in prompts],
        [job.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples],
        [p.ground_truth for p in prompts],
        [p.extras for p in prompts],
    )
    return validation_metrics(result, samples)
