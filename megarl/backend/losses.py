"""The actor's and critic's RL losses as Megatron loss functions (one micro-batch's output -> loss, metrics).

Normalisation is global. Each micro-batch returns its *contribution* to the mini-batch's aggregate (its sum divided
by the mini-batch's token or sequence count over all micro-batches and DP ranks, ``GlobalNorm``), multiplied by
``scale`` = (micro-batches on this rank) x (DP size): Megatron's schedule divides every micro-batch loss by the
number of micro-batches and DDP averages gradients over DP, so the gradient is exactly that of the global aggregate,
whatever the micro-batch split and layout. Metrics are contributions too (token means over the global mini-batch),
reduced by summing (``max/`` keys by maximum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algos import (
    aggregate,
    gspo_policy_loss,
    kl_loss_terms,
    ppo_policy_loss,
    rollout_is_weights,
    value_loss,
    vocab_parallel_entropy,
)
from megarl.backend.logprobs import tp_all_reduce, tp_logprobs, tp_truncation
from megarl.config.schema import ActorConfig, AlgorithmConfig, CriticConfig


@dataclass(frozen=True)
class GlobalNorm:
    """The denominators of one mini-batch, over all its micro-batches and DP ranks."""

    tokens: int
    """Response tokens in the mini-batch."""
    seqs: int
    """Sequences in the mini-batch."""
    norm_len: int
    """seq-mean-token-sum-norm's constant length."""
    scale: float
    """Micro-batches on this rank x DP size (undoes Megatron's per-micro-batch and DP averaging)."""

    def aggregate(self, loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str) -> torch.Tensor:
        return aggregate(
            loss_BT, mask_BT, mode, global_tokens=self.tokens, global_seqs=self.seqs, norm_len=self.norm_len
        )

    def token_mean(self, x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        return self.aggregate(x_BT.detach(), mask_BT, "token-mean")


def _tp_entropy(logits_BSV: torch.Tensor, temperature: float, true_vocab: int) -> torch.Tensor:
    """Entropy of softmax(logits / T) over the true vocabulary (the whole of it, whatever the sampler truncates: a
    kept set of one token has entropy 0 and no gradient), from this TP rank's vocabulary slice."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits_BSV.float() / temperature if temperature != 1 else logits_BSV
    return vocab_parallel_entropy(
        z,
        vocab_start=ps.get_tensor_model_parallel_rank() * logits_BSV.shape[-1],
        true_vocab=true_vocab,
        all_reduce_sum=reduce_from_tensor_model_parallel_region,
        all_reduce_max=tp_all_reduce(dist.ReduceOp.MAX),  # stabilises only: not differentiated
    )


POLICY_LOSSES = {
    "ppo": lambda logp, old, adv, mask, a: ppo_policy_loss(
        logp, old, adv, clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high, clip_c=a.clip_ratio_c
    ),
    "gspo": lambda logp, old, adv, mask, a: gspo_policy_loss(
        logp, old, adv, mask, clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high
    ),
}


def actor_loss(
    actor: ActorConfig,
    algo: AlgorithmConfig,
    norm: GlobalNorm,
    *,
    temperature: float,
    true_vocab: int,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """Loss function for one actor mini-batch. Micro-batch fields: ``advantages``, ``rollout_logp``, and optionally
    ``old_logp`` (absent: the policy before this update is the current one, so old = current, detached) and
    ``ref_logp`` (with a KL loss). The policy is the sampler's: softmax(logits / temperature) over the tokens its
    top-k / top-p keep (all tokens when they are off)."""

    def loss_fn(mb: dict, logits_BSV: torch.Tensor):
        mask = mb["loss_mask"]
        truncation = tp_truncation(logits_BSV, mb["targets"], temperature, true_vocab, top_k, top_p)
        # the entropy (of the whole softmax) comes from the log-probs' own pass where that is the whole softmax; a
        # bonus needs its gradient, and a truncated pass has the kept set's: a pass of its own
        bonus = actor.entropy_coeff != 0
        own_pass = not bonus and truncation is None
        logp, entropy = tp_logprobs(logits_BSV, mb["targets"], temperature, true_vocab, with_entropy=own_pass,
                                    truncation_BS=truncation)  # fmt: skip
        old = mb["old_logp"] if "old_logp" in mb else logp.detach()
        # seq_mask's rejected sequences already left loss_mask (``learn``): the accepted ones keep their weight here
        is_w = rollout_is_weights(old, mb["rollout_logp"], mask, algo.rollout_is, algo.rollout_is_cap,
                                  algo.rollout_is_level)  # fmt: skip
        pg = POLICY_LOSSES[actor.policy_loss](logp, old, mb["advantages"], mask, actor)
        pg_loss = norm.aggregate(pg["loss"] * is_w["weights"], mask, actor.pg_agg_mode)
        loss = pg_loss
        if not own_pass:
            with torch.set_grad_enabled(bonus and torch.is_grad_enabled()):
                entropy = _tp_entropy(logits_BSV, temperature, true_vocab)
        if bonus:
            loss = loss - actor.entropy_coeff * norm.aggregate(entropy, mask, actor.agg_mode)
        metrics = {
            "actor/pg_loss": pg_loss.detach(),
            "actor/pg_clipfrac": norm.token_mean(pg["clipped"], mask),
            "actor/pg_clipfrac_lower": norm.token_mean(pg["dual_clipped"], mask),
            "actor/ppo_kl": norm.token_mean(pg["approx_kl"], mask),
            "actor/entropy": norm.aggregate(entropy.detach(), mask, actor.agg_mode),  # as the bonus (verl)
            "rollout/is_weight_mean": norm.token_mean(is_w["weights"], mask),
            "rollout/is_masked_frac": norm.token_mean(is_w["masked"], mask),
        }
        if "old_logp" not in mb:  # the pre-update policy is this forward: compare it with the engine's here
            diff = (old - mb["rollout_logp"]).abs() * mask
            metrics["rollout/logprob_mismatch_mean"] = norm.token_mean(diff, mask)
            metrics["max/rollout/logprob_mismatch_max"] = diff.max().detach()
        if actor.kl_loss_coef > 0:  # on response positions only: elsewhere ref_logp is 0, not a log-prob
            ref = torch.where(mask.bool(), mb["ref_logp"], logp.detach())
            # off-policy tokens (rollout_is on: async weights, the engine's numerics) weigh by min(pi_old / mu, cap)
            mu = mb["rollout_logp"] if algo.rollout_is != "off" else None
            terms = kl_loss_terms(logp, ref, old, actor.kl_loss_type, mu, algo.rollout_is_cap)
            kl_loss = norm.aggregate(terms, mask, actor.agg_mode)
            loss = loss + actor.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        return loss * norm.scale, metrics

    return loss_fn


def critic_loss(critic: CriticConfig, norm: GlobalNorm):
    """Loss function for one critic mini-batch. Micro-batch fields: ``old_values`` (at rollout) and ``returns``."""

    def loss_fn(mb: dict, values_BS1: torch.Tensor):
        mask = mb["loss_mask"]
        values = values_BS1.squeeze(-1).float()
        vl = value_loss(values, mb["old_values"], mb["returns"], critic.cliprange_value)
        loss = norm.aggregate(vl["loss"], mask, critic.loss_agg_mode)
        metrics = {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": norm.token_mean(vl["clipped"], mask)}
        return loss * norm.scale, metrics

    return loss_fn


def critic_values(mb: dict, values_BS1: torch.Tensor) -> torch.Tensor:
    """Per-position values [b, S] of a critic forward (for ``forward_per_token``)."""
    return values_BS1.squeeze(-1).float()
