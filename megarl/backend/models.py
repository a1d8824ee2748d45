"""The Megatron models of an RL job: the trainable actor, the critic (only for GAE) and the frozen reference (only
when a KL term is on). Colocated, every rank builds all of them at the actor's layout; with pools, each pool builds
the models of the roles it hosts, at its own layout."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megarl.backend.init_weights import load_initial_weights
from megarl.backend.moe import LoadBalancing, RoutingReplay
from megarl.backend.setup import make_scheduler, wrap_for_training
from megarl.config.recipe import needs_critic, needs_reference, needs_reward_model, reward_model_spec
from megarl.config.schema import MegarlConfig
from megarl.lora import adapters_off, apply_lora, read_peft_adapter
from megarl.models.builder import build_model_chunk
from megarl.models.source import ModelSource
from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout


@dataclass
class RLModels:
    actor: torch.nn.Module | None
    """The actor, wrapped in Megatron DDP (None on a pool without it)."""
    actor_optim: object | None
    actor_sched: object | None
    """The actor's learning-rate scheduler (Megatron's OptimizerParamScheduler)."""
    critic: torch.nn.Module | None = None
    critic_optim: object | None = None
    critic_sched: object | None = None
    reference: torch.nn.Module | None = None
    """Frozen initial actor weights (no DDP, no optimizer)."""
    reference_is_base: bool = False
    """LoRA: the reference is the actor with its adapters off (no second copy of the weights)."""
    reward_model: torch.nn.Module | None = None
    """A frozen reward model with a scalar score head (``reward.model``)."""
    actor_balancing: LoadBalancing | None = None
    """A routed-expert actor's load-balancing loss (``actor.moe_aux_loss_coef``; logged at any coefficient)."""
    actor_replay: RoutingReplay | None = None
    """The engine's routes in the actor's routers (``actor.moe_routing_replay``: measured, or replayed)."""


ALL_ROLES = ("actor", "critic", "reference", "reward_model")


def build_rl_models(
    cfg: MegarlConfig,
    spec: ModelSpec,
    layout: ParallelLayout,
    source: ModelSource,
    rank: int,
    *,
    load_weights=True,
    roles=ALL_ROLES,
):
    """Collective: every model this job needs among ``roles`` (this rank's pool's), initialised from ``source`` at
    ``layout``. ``load_weights=False`` (resuming: a checkpoint fills actor and critic next) loads only the reference,
    which is always the initial weights."""

    replay = cfg.actor.moe_routing_replay

    def chunk(value_head: bool = False, load: bool = True, trained: bool = True, actor: bool = False):
        model = build_model_chunk(
            spec,
            layout,
            value_head=value_head,
            dtype=cfg.model.dtype,
            transformer_impl=cfg.model.transformer_impl,
            init_weights=False,
            recompute=cfg.model.recompute and trained,
            attention=cfg.model.attention,
            compile_elementwise=cfg.model.compile_elementwise,
            routing_replay=actor and replay == "rollout",  # the reference and the critic route themselves
        )
        if load:
            load_initial_weights(model, source, spec, layout, rank, value_head=value_head)
        return model

    models = RLModels(actor=None, actor_optim=None, actor_sched=None)
    if "actor" in roles:  # LoRA: the base is never in a checkpoint, so it is always loaded
        add_actor(models, chunk(load=load_weights or cfg.actor.lora is not None, actor=True), cfg, spec)
    if needs_critic(cfg) and "critic" in roles:
        models.critic, models.critic_optim = wrap_for_training(
            chunk(value_head=True, load=load_weights), cfg.critic.optim
        )
        models.critic_sched = make_scheduler(models.critic_optim, cfg.critic.optim)
    if needs_reference(cfg) and "reference" in roles and cfg.actor.lora is not None:
        models.reference_is_base = True
    elif needs_reference(cfg) and "reference" in roles:
        models.reference = chunk(trained=False).eval().requires_grad_(False)
    if needs_reward_model(cfg) and "reward_model" in roles:
        rm_source, rm_spec = reward_model_spec(cfg)
        rm = build_model_chunk(rm_spec, layout, dtype=cfg.model.dtype, transformer_impl=cfg.model.transformer_impl,
                               init_weights=False, attention=cfg.model.attention,
                               compile_elementwise=cfg.model.compile_elementwise)  # fmt: skip
        load_initial_weights(rm, rm_source, rm_spec, layout, rank)
        models.reward_model = rm.eval().requires_grad_(False)
    return models


def add_actor(models: RLModels, actor_chunk, cfg: MegarlConfig, spec: ModelSpec) -> None:
    """The actor into ``models``: its adapters, its routers' hooks, DDP, optimizer and scheduler."""
    if cfg.actor.lora is not None:  # before DDP: the frozen base gets no gradient buffer or optimizer state
        add_adapters(actor_chunk, cfg, spec)
    if spec.is_moe:
        models.actor_balancing = LoadBalancing(actor_chunk, cfg.actor.moe_aux_loss_coef)
    if cfg.actor.moe_routing_replay != "off":
        replay = cfg.actor.moe_routing_replay == "rollout"
        models.actor_replay = RoutingReplay(actor_chunk, spec.routed_layers, replay=replay)
    models.actor, models.actor_optim = wrap_for_training(actor_chunk, cfg.actor.optim)
    models.actor_sched = make_scheduler(models.actor_optim, cfg.actor.optim)


def add_adapters(chunk, cfg: MegarlConfig, spec: ModelSpec) -> int:
    """``actor.lora``: freeze ``chunk`` and hook its adapters (from ``init_from`` or fresh); their parameter count."""
    from megatron.core import parallel_state as ps

    lora = cfg.actor.lora
    full = read_peft_adapter(lora.init_from, lora, spec) if lora.init_from else None
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    return apply_lora(chunk, spec, lora, tp_rank, tp, full=full, seed=cfg.trainer.seed)


@contextlib.contextmanager
def reference_policy(models: RLModels):
    """The model whose log-probs are the reference's: the frozen copy, or (LoRA) the actor with its adapters off;
    None when no KL term needs one."""
    if models.reference is not None:
        yield models.reference
    elif models.reference_is_base:
        with adapters_off(models.actor):
            yield models.actor
    else:
        yield None
