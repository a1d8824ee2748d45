"""Rewards: built-in rule-based functions, loading user functions, and scoring that never loses a run (a user's
function runs in worker processes: ``megarl.rewards.worker_pool``)."""

from megarl.rewards.registry import BUILTIN_REWARDS, RewardLoadError, load_reward_fn
from megarl.rewards.results import RewardFailure, ScoreResult, score_batch

__all__ = ["BUILTIN_REWARDS", "RewardFailure", "RewardLoadError", "ScoreResult", "load_reward_fn", "score_batch"]
