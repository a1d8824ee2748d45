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

from megarl.backend.batch import Sequence
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


@dataclass
class Batching:
    """How a role cuts the step's sequences: mini-batches of ``global_batch_size`` sequences, micro-batches of
    ``max_tokens`` tokens (0: ``micro_batch_size`` sequences)."""

    global_batch_size: int
    max_tokens: int
    micro_batch_size: int


class Role:
    """A model of the step on the pool that hosts ``name``."""

    name = ""

    def __init__(self, place: Placement):
        self.place = place
        self.busy_s = 0.0
        """Seconds this rank computed for the role (``pool/<name>/busy_s``); reset by the step."""

    @property
    def here(self) -> bool:
        return self.place.hosts(self.name)

    def _on_host(self, compute):
        """``compute()`` on the hosting pool's ranks; its result (the pool's first rank's) on every rank."""

        def timed():
            start = time.perf_counter()
            try:
                return compute()
            finally:
                self.busy_s += time.perf_counter() - start

        return self.place.compute_on(self.name, timed)

    def _update(self, run) -> Update:
        def guarded() -> Update:
            try:
                return Update(run())
            except NonFiniteUpdate as e:
                return Update(skipped=str(e))

        return self._on_host(guarded)


def _logprobs(cfg, spec, model, seqs: list[Sequence], batching: Batching, *, truncated: bool) -> list[torch.Tensor]:
    """Per response token, log p at the rollout's temperature; ``truncated``: over the sampler's top-k / top-p."""
    s = cfg.rollout.sampling
    top_k, top_p = (s.top_k, s.top_p) if truncated else (0, 1.0)
    per_token = lambda mb, logits: logprobs_from_logits(logits, mb["targets"], s.temperature, spec.vocab_size,
                                                        top_k, top_p)  # fmt: skip
    return forward_fields(
        model,
        seqs,
        per_token,
        global_batch_size=batching.global_batch_size,
        max_tokens=batching.max_tokens,
        micro_batch_size=batching.micro_batch_size,
    )


class _PolicyRole(Role):
    """A policy model (the actor or the reference): log-probs at the actor's micro-batching."""

    def __init__(self, cfg, spec, models: RLModels | None, place: Placement):
        super().__init__(place)
        a = cfg.actor
        self.cfg, self.spec, self.models = cfg, spec, models
        self.batching = Batching(a.global_batch_size, a.max_tokens_per_micro_batch, a.micro_batch_size)


class Actor(_PolicyRole):
    """The trained policy."""

    name = "actor"

    def logprobs(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Per response token, log pi(token) under the current weights: the sampler's policy (the rollout's
        temperature, top-k and top-p)."""
        return self._on_host(
            lambda: _logprobs(self.cfg, self.spec, self.models.actor, seqs, self.batching, truncated=True)
        )

    def update(self, seqs: list[Sequence], fields: dict, *, trained: list[bool] | None = None) -> Update:
        """``actor.ppo_epochs`` passes of one optimizer step per mini-batch on the policy loss; ``fields`` hold the
        advantages, rollout (and old, reference) log-probs; ``trained``: the sequences that count (seq_mask)."""
        cfg, a = self.cfg, self.cfg.actor
        s = cfg.rollout.sampling
        loss = partial(actor_loss, a, cfg.algorithm, temperature=s.temperature, true_vocab=self.spec.vocab_size,
                       top_k=s.top_k, top_p=s.top_p)  # fmt: skip
        return self._update(
            lambda: ppo_updates(
                self.models.actor,
                self.models.actor_optim,
                seqs,
                fields,
                loss,
                global_batch_size=a.global_batch_size,
                epochs=a.ppo_epochs,
                max_tokens=a.max_tokens_per_micro_batch,
                micro_batch_size=a.micro_batch_size,
                norm_len=a.loss_agg_norm_len or cfg.rollout.sampling.max_new_tokens,
                scheduler=self.models.actor_sched,
                trained=trained,
            )
        )


class Reference(_PolicyRole):
    """The frozen initial policy (a copy, or with LoRA the actor with its adapters off). Its log-probs are over the
    whole vocabulary, whatever the sampler truncates: the KL is to the reference model itself."""

    name = "reference"

    def logprobs(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        def compute():
            with reference_policy(self.models) as reference:
                return _logprobs(self.cfg, self.spec, reference, seqs, self.batching, truncated=False)

        return self._on_host(compute)


class Critic(Role):
    """The value model (GAE)."""

    name = "critic"

    def __init__(self, cfg, models: RLModels | None, place: Placement):
        super().__init__(place)
        c = cfg.critic
        self.cfg, self.models = cfg, models
        self.batching = Batching(cfg.actor.global_batch_size, c.max_tokens_per_micro_batch, c.micro_batch_size)

    def values(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Per response token, V(state before it)."""
        b = self.batching
        return self._on_host(
            lambda: forward_fields(
                self.models.critic,
                seqs,
                critic_values,
                global_batch_size=b.global_batch_size,
                max_tokens=b.max_tokens,
                micro_batch_size=b.micro_batch_size,
            )
        )

    def update(self, seqs: list[Sequence], fields: dict) -> Update:
        """``critic.ppo_epochs`` passes on the clipped value loss against ``fields['returns']``."""
        c, b = self.cfg.critic, self.batching
        return self._update(
            lambda: ppo_updates(
                self.models.critic,
                self.models.critic_optim,
                seqs,
                fields,
                partial(critic_loss, c),
                global_batch_size=b.global_batch_size,
                epochs=c.ppo_epochs,
                max_tokens=b.max_tokens,
                micro_batch_size=b.micro_batch_size,
                norm_len=self.cfg.actor.loss_agg_norm_len or self.cfg.rollout.sampling.max_new_tokens,
                scheduler=self.models.critic_sched,
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
        self.batching = Batching(cfg.actor.global_batch_size, r.max_tokens_per_micro_batch, r.micro_batch_size)

    def scores(self, sequences: list[list[int]]) -> list[float]:
        """Prompt + response token ids -> their scores."""
        b = self.batching
        return self._on_host(
            lambda: reward_model_scores(
                self.models.reward_model, sequences, self.pad_token_id, global_batch_size=b.global_batch_size,
                max_tokens=b.max_tokens, micro_batch_size=b.micro_batch_size,
            )
        )  # fmt: skip


@dataclass
class Roles:
    """The step's roles; ``reference``, ``critic`` and ``reward_model`` are None when the recipe needs none."""

    actor: Actor
    reference: Reference | None
    critic: Critic | None
    reward_model: RewardModel | None = None

    def busy_s(self) -> float:
        """Seconds this rank computed for its roles since the last call."""
        roles = [r for r in (self.actor, self.reference, self.critic, self.reward_model) if r is not None]
        total = sum(r.busy_s for r in roles)
        for r in roles:
            r.busy_s = 0.0
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
