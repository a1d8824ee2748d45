"""From a step's rewards (and values / log-probs) to per-token advantages, by ``algorithm.adv_estimator``.

Everything here runs on the whole batch on every rank (identical inputs, identical results), so batch statistics
(whitening, group baselines) are global whatever the layout. Response-aligned tensors are [N, R], right-padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algos import (
    broadcast_to_tokens,
    gae,
    grpo,
    kl_estimate,
    kl_penalty_rewards,
    kl_value_estimator,
    masked_mean,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    token_level_scores,
)
from megarl.config.schema import AlgorithmConfig


def pad_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """[N, R] from N 1-D tensors of different lengths (zeros on the right)."""
    width = max(len(r) for r in rows)
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def unpad_rows(x_NR: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return [x_NR[i, :n].clone() for i, n in enumerate(lengths)]


@dataclass
class AdvantageInputs:
    """One step's batch, response-aligned."""

    rewards_N: torch.Tensor
    """Sequence rewards (score + shaping)."""
    group_N: torch.Tensor
    """Prompt index of each sequence (GRPO / RLOO groups)."""
    mask_NR: torch.Tensor
    token_rewards_NR: torch.Tensor
    """Rewards per token: the sequence reward on the last token, minus the KL penalty when it is in the reward."""
    values_NR: torch.Tensor | None
    """Critic values at rollout (GAE only)."""


def _outcome(inp: AdvantageInputs) -> torch.Tensor:
    """Sequence reward including any in-reward KL penalty."""
    return (inp.token_rewards_NR * inp.mask_NR).sum(-1)


ESTIMATORS = {
    "gae": lambda inp, a: gae(inp.token_rewards_NR, inp.values_NR, inp.mask_NR, a.gamma, a.lam),
    "grpo": lambda inp, a: (
        broadcast_to_tokens(grpo(_outcome(inp), inp.group_N, norm_by_std=a.norm_adv_by_std), inp.mask_NR),
        None,
    ),
    "rloo": lambda inp, a: (broadcast_to_tokens(rloo(_outcome(inp), inp.group_N), inp.mask_NR), None),
    "reinforce_pp": lambda inp, a: reinforce_pp(inp.token_rewards_NR, inp.mask_NR, a.gamma),
    "reinforce_pp_baseline": lambda inp, a: (reinforce_pp_baseline(_outcome(inp), inp.group_N, inp.mask_NR), None),
}
"""adv_estimator -> (inputs, AlgorithmConfig) -> (advantages [N, R], returns [N, R] or None)."""


def advantages(
    algo: AlgorithmConfig,
    rewards_N: torch.Tensor,
    group_N: torch.Tensor,
    mask_NR: torch.Tensor,
    *,
    behaviour_logp_NR: torch.Tensor,
    ref_logp_NR: torch.Tensor | None,
    values_NR: torch.Tensor | None,
    kl_ctrl,
    kl_metric_type: str,
    token_rewards_NR: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """Advantages (and returns for GAE / REINFORCE++), plus the ``kl/*`` metrics; updates an adaptive KL controller.
    ``token_rewards_NR``: the rewards per token (summing to ``rewards_N``; per-turn credit), else each sequence's
    reward on its last token."""
    token_rewards = token_level_scores(rewards_N, mask_NR) if token_rewards_NR is None else token_rewards_NR
    metrics = {}
    if ref_logp_NR is not None:
        kind = algo.kl_penalty if algo.kl_in_reward else kl_value_estimator(kl_metric_type)
        metrics["kl/ref_mean"] = float(masked_mean(kl_estimate(behaviour_logp_NR, ref_logp_NR, kind), mask_NR))
    if algo.kl_in_reward:
        metrics["kl/coef"] = float(kl_ctrl.value)
        token_rewards, kl_mean = kl_penalty_rewards(
            token_rewards, behaviour_logp_NR, ref_logp_NR, mask_NR, kl_ctrl.value, algo.kl_penalty
        )
        kl_ctrl.update(kl_mean, n_steps=len(rewards_N))
    inputs = AdvantageInputs(rewards_N, group_N, mask_NR, token_rewards, values_NR)
    adv, returns = ESTIMATORS[algo.adv_estimator](inputs, algo)
    return adv, returns, metrics
