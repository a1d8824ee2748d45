"""The models of an RL step as roles: each owns its model, optimizer, micro-batching and placement, so the step reads
as calls on roles (``actor.logprobs(seqs)``, ``critic.update(seqs, fields)``) wherever a role lives.

Every rank calls every role (collective over the launch). The ranks of the pool that hosts a role compute; the result
then reaches every rank (``Placement.share``: nothing crosses when colocated, where every rank hosts every role). An
update whose loss or gradients are not finite is not applied; it comes back as ``Update.skipped``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch

from megarl.backend.batch import Batching, PackStats, Sequence
from megarl.backend.logprobs import logprobs_from_logits
from megarl.backend.losses import actor_loss, critic_loss, critic_values
from megarl.backend.models import RLModels, reference_policy
from megarl.backend.step import NonFiniteUpdate
from megarl.backend.update import forward_fields, ppo_updates
from megarl.config.recipe import needs_critic, needs_reference, needs_reward_model, reward_model_spec
from megarl.parallel.pools import Placement
from megarl.rewards.model import reward_model_scores


@dataclass
class Update:
    """What one role's update did (the same on every rank)."""

    metrics: dict[str, float] = field(default_factory=dict)
    skipped: str | None = None
    """Why the update was not applied ("non-finite pg_loss"), or None."""


class Role:
    """A model of the step on the pool that hosts ``name``."""

    name = ""

    def __init__(self, place: Placement):
        self.place = place
        self.busy_s = 0.0
        """Seconds this rank computed for the role (``pool/<name>/busy_s``); reset by the step."""
        self.packed = PackStats()
        """The micro-batches its passes ran (``perf/padding_frac``, ``perf/micro_batches``); reset by the step."""

    @property
    def here(self) -> bool:
        return self.place.hosts(self.name)

    def _on_host(self, compute):
        """``compute(stats)`` on the hosting pool's ranks; its result (the pool's first rank's) on every rank, and
        the micro-batches it counted into ``stats`` added to ``packed``."""

        def timed():
            start, stats = time.perf_counter(), PackStats()
            try:
                return compute(stats), stats
            finally:
                self.busy_s += time.perf_counter() - start

        result, stats = self.place.compute_on(self.name, timed)
        self.packed.add(stats)
        return result

    def _update(self, run) -> Update:
        def guarded(stats: PackStats) -> Update:
            try:
                return Update(run(stats))
            except NonFiniteUpdate as e:
                return Update(skipped=str(e))

        return self._on_host(guarded)


def _logprobs(cfg, spec, model, seqs: list[Sequence], batching: Batching, stats: PackStats,
              replay=None) -> list[torch.Tensor]:  # fmt: skip
    """Per response token, log p under the sampler's policy of ``model`` (the rollout's temperature, over the tokens
    its top-k / top-p keep); ``replay``: the sequences' routes in the model's routers."""
    s = cfg.rollout.sampling
    per_token = lambda mb, logits: logprobs_from_logits(logits, mb["targets"], s.temperature, spec.vocab_size,
                                                        s.top_k, s.top_p)  # fmt: skip
    return forward_fields(model, seqs, per_token, batching, stats, replay)


def batching_of(cfg, role) -> Batching:
    """How ``role`` (the actor's, critic's or reward model's config) cuts the step's sequences: its micro-batch
    size and token budget, the actor's mini-batches and packing."""
    a = cfg.actor
    return Batching(a.global_batch_size, role.max_tokens_per_micro_batch, role.micro_batch_size, a.packing)


class _PolicyRole(Role):
    """A policy model (the actor or the reference): log-probs at the actor's micro-batching."""

    def __init__(self, cfg, spec, models: RLModels | None, place: Placement):
        super().__init__(place)
        a = cfg.actor
        self.cfg, self.spec, self.models = cfg, spec, models
        self.batching = batching_of(cfg, a)


class Actor(_PolicyRole):
    """The trained policy."""

    name = "actor"

    def logprobs(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Per response token, log pi(token) under the current weights: the sampler's policy (the rollout's
        temperature, top-k and top-p)."""
        return self._on_host(
            lambda stats: _logprobs(self.cfg, self.spec, self.models.actor, seqs, self.batching, stats,
                                    replay=self.models.actor_replay)
        )  # fmt: skip

    def update(self, seqs: list[Sequence], fields: dict, *, trained: list[bool] | None = None) -> Update:
        """``actor.ppo_epochs`` passes of one optimizer step per mini-batch on the policy loss; ``fields`` hold the
        advantages, rollout (and old, reference) log-probs; ``trained``: the sequences that count (seq_mask)."""
        cfg, a = self.cfg, self.cfg.actor
        s = cfg.rollout.sampling
        loss = partial(actor_loss, a, cfg.algorithm, temperature=s.temperature, true_vocab=self.spec.vocab_size,
                       top_k=s.top_k, top_p=s.top_p)  # fmt: skip
        return self._update(
            lambda stats: ppo_updates(
                self.models.actor,
                self.models.actor_optim,
                seqs,
                fields,
                loss,
                self.batching,
                epochs=a.ppo_epochs,
                norm_len=a.loss_agg_norm_len or cfg.rollout.sampling.max_new_tokens,
                scheduler=self.models.actor_sched,
                trained=trained,
                stats=stats,
                balancing=self.models.actor_balancing,
                replay=self.models.actor_replay,
            )
        )


class Reference(_PolicyRole):
    """The frozen initial policy (a copy, or with LoRA the actor with its adapters off). Its log-probs are under the
    same sampler as the actor's (temperature, top-k, top-p applied to the reference's own logits, the token kept):
    the KL is between the two truncated policies, 0 where they are equal. (Over the whole vocabulary, the reference
    would give every token -log ref(kept set) > 0 of KL at pi = ref: a length and entropy penalty.)"""

    name = "reference"

    def logprobs(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        def compute(stats: PackStats):
            with reference_policy(self.models) as reference:
                return _logprobs(self.cfg, self.spec, reference, seqs, self.batching, stats)

        return self._on_host(compute)


class Critic(Role):
    """The value model (GAE)."""

    name = "critic"

    def __init__(self, cfg, models: RLModels | None, place: Placement):
        super().__init__(place)
        c = cfg.critic
        self.cfg, self.models = cfg, models
        self.batching = batching_of(cfg, c)

    def values(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Per response token, V(state before it)."""
        return self._on_host(
            lambda stats: forward_fields(self.models.critic, seqs, critic_values, self.batching, stats)
        )

    def update(self, seqs: list[Sequence], fields: dict) -> Update:
        """``critic.ppo_epochs`` passes on the clipped value loss against ``fields['returns']``."""
        c = self.cfg.critic
        return self._update(
            lambda stats: ppo_updates(
                self.models.critic,
                self.models.critic_optim,
                seqs,
                fields,
                partial(critic_loss, c),
                self.batching,
                epochs=c.ppo_epochs,
                norm_len=self.cfg.actor.loss_agg_norm_len or self.cfg.rollout.sampling.max_new_tokens,
                scheduler=self.models.critic_sched,
                stats=stats,
            )
        )


class RewardModel(Role):
    """A frozen reward model: one score per whole sequence, where HF's classification head reads it."""

    name = "reward_model"

    def __init__(self, cfg, models: RLModels | None, place: Placement):
        super().__init__(place)
        r = cfg.reward.model
        self.models = models
        self.pad_token_id = reward_model_spec(cfg)[0].hf_config.get("pad_token_id")
        self.batching = batching_of(cfg, r)

    def scores(self, sequences: list[list[int]]) -> list[float]:
        """Prompt + response token ids -> their scores."""
        return self._on_host(
            lambda stats: reward_model_scores(self.models.reward_model, sequences, self.pad_token_id, self.batching,
                                              stats)
        )  # fmt: skip


@dataclass
class Roles:
    """The step's roles; ``reference``, ``critic`` and ``reward_model`` are None when the recipe needs none."""

    actor: Actor
    reference: Reference | None
    critic: Critic | None
    reward_model: RewardModel | None = None

    def present(self) -> list[Role]:
        return [r for r in (self.actor, self.reference, self.critic, self.reward_model) if r is not None]

    def busy_s(self) -> float:
        """Seconds this rank computed for its roles since the last call."""
        total = sum(r.busy_s for r in self.present())
        for r in self.present():
            r.busy_s = 0.0
        return total

    def packed(self) -> PackStats:
        """The micro-batches the roles' passes ran since the last call (the same on every rank)."""
        total = PackStats()
        for r in self.present():
            total.add(r.packed.take())
        return total


def make_roles(cfg, spec, models: RLModels | None, place: Placement | None = None) -> Roles:
    """The step's roles over this rank's ``models`` (None on a pool that hosts no model). Colocated, the models
    built say which roles exist; with pools, the recipe does (``needs_reference``/``needs_critic``)."""
    place = place or Placement.colocated()
    if place.pooled:
        has_reference, has_critic = needs_reference(cfg), needs_critic(cfg)
    else:
        has_reference = models.reference is not None or models.reference_is_base
        has_critic = models.critic is not None
    return Roles(
        Actor(cfg, spec, models, place),
        Reference(cfg, spec, models, place) if has_reference else None,
        Critic(cfg, models, place) if has_critic else None,
        RewardModel(cfg, models, place) if needs_reward_model(cfg) else None,
    )
