"""Pure tensor functions of RL post-training: advantage estimators, policy/value losses, KL, aggregation."""

from megarl.algos.advantages import (
    broadcast_to_tokens,
    gae,
    grpo,
    masked_mean,
    masked_var,
    masked_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    token_level_scores,
)
from megarl.algos.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_controller,
    kl_estimate,
    kl_loss_terms,
    kl_penalty_rewards,
    kl_value_estimator,
)
from megarl.algos.losses import (
    aggregate,
    gspo_policy_loss,
    ppo_policy_loss,
    rollout_is_weights,
    value_loss,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "broadcast_to_tokens",
    "gae",
    "grpo",
    "gspo_policy_loss",
    "kl_controller",
    "kl_estimate",
    "kl_loss_terms",
    "kl_penalty_rewards",
    "kl_value_estimator",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "rollout_is_weights",
    "token_level_scores",
    "value_loss",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]
