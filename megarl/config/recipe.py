"""What a recipe needs, read from its config alone: which models the run builds and which forwards the step
runs. Below everything that builds or plans a run (the trainer, the planner, the validation)."""

from __future__ import annotations

from megarl.config.schema import MegarlConfig
from megarl.models.source import ModelSource, model_source
from megarl.models.spec import ModelSpec, spec_from_hf_config


def needs_reference(cfg: MegarlConfig) -> bool:
    """A frozen reference is built: a KL term is on (in the loss or in the reward)."""
    return cfg.actor.kl_loss_coef > 0 or cfg.algorithm.kl_in_reward


def needs_critic(cfg: MegarlConfig) -> bool:
    """A critic is built: GAE advantages need values."""
    return cfg.algorithm.adv_estimator == "gae"


def needs_reward_model(cfg: MegarlConfig) -> bool:
    """A reward model scores the samples (``reward.model``)."""
    return cfg.reward.model is not None


def skips_old_logprob(cfg: MegarlConfig) -> bool:
    """One mini-batch and one epoch: the policy before the update is the current one, so the update's own forward
    gives the old log-probs. Not with the KL in the reward (the penalty and its controller must see the trainer's
    log-probs, not the engine's), nor with sequence-level rejection (it needs whole sequences' old log-probs before
    the update's counts are formed), nor one-step-off (the engine's log-probs are one update old: pi_old is the
    trainer's, and the mismatch by lag is logged)."""
    one_minibatch = cfg.data.train_batch_size * cfg.rollout.sampling.n == cfg.actor.global_batch_size
    return cfg.actor.ppo_epochs == 1 and one_minibatch and old_logprobs_needed_by(cfg) is None


def old_logprobs_needed_by(cfg: MegarlConfig) -> str | None:
    """What needs the trainer's own old log-probs whatever the mini-batches (the start-up log names it), or None."""
    if cfg.algorithm.kl_in_reward:
        return "the KL in the reward"
    if cfg.algorithm.rollout_is == "seq_mask":
        return "rollout_is=seq_mask"
    if cfg.async_training.overlapped:
        return f"async_training.mode={cfg.async_training.mode} (the engine's weights are older than the actor's)"
    return None


def reward_model_spec(cfg: MegarlConfig) -> tuple[ModelSource, ModelSpec]:
    """The reward model's source and spec (``reward.model.path``)."""
    source = model_source(cfg.reward.model.path)
    return source, spec_from_hf_config(source.hf_config)
