"""The Megatron models of an RL job, colocated on every rank at the actor's layout: the trainable actor, the
critic (only for GAE) and the frozen reference (only when a KL term is on)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.config.schema import MegarlConfig
from megarl.models.builder import build_model_chunk
from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.training.init_weights import ModelSource, load_initial_weights
from megarl.training.setup import make_scheduler, wrap_for_training


@dataclass
class RLModels:
    actor: torch.nn.Module
    """The actor, wrapped in Megatron DDP."""
    actor_optim: object
    actor_sched: object
    """The actor's learning-rate scheduler (Megatron's OptimizerParamScheduler)."""
    critic: torch.nn.Module | None = None
    critic_optim: object | None = None
    critic_sched: object | None = None
    reference: torch.nn.Module | None = None
    """Frozen initial actor weights (no DDP, no optimizer)."""


def needs_reference(cfg: MegarlConfig) -> bool:
    return cfg.actor.kl_loss_coef > 0 or cfg.algorithm.kl_in_reward


def needs_critic(cfg: MegarlConfig) -> bool:
    return cfg.algorithm.adv_estimator == "gae"


def build_rl_models(
    cfg: MegarlConfig, spec: ModelSpec, layout: ParallelLayout, source: ModelSource, rank: int, *, load_weights=True
):
    """Collective: every model this job needs, initialised from ``source``. ``load_weights=False`` (resuming: a
    checkpoint fills actor and critic next) loads only the reference, which is always the initial weights."""

    def chunk(value_head: bool = False, load: bool = True, trained: bool = True):
        model = build_model_chunk(
            spec,
            layout,
            value_head=value_head,
            dtype=cfg.model.dtype,
            transformer_impl=cfg.model.transformer_impl,
            init_weights=False,
            recompute=cfg.model.recompute and trained,
        )
        if load:
            load_initial_weights(model, source, spec, layout, rank, value_head=value_head)
        return model

    actor, actor_optim = wrap_for_training(chunk(load=load_weights), cfg.actor.optim)
    models = RLModels(actor=actor, actor_optim=actor_optim, actor_sched=make_scheduler(actor_optim, cfg.actor.optim))
    if needs_critic(cfg):
        models.critic, models.critic_optim = wrap_for_training(
            chunk(value_head=True, load=load_weights), cfg.critic.optim
        )
        models.critic_sched = make_scheduler(models.critic_optim, cfg.critic.optim)
    if needs_reference(cfg):
        models.reference = chunk(trained=False).eval().requires_grad_(False)
    return models
