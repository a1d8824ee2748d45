"""Rewards: built-in rule-based functions, loading user functions, and scoring that never loses a run."""

from megarl.rewards.registry import BUILTIN_REWARDS, RewardLoadError, load_reward_fn
from megarl.rewards.score import ScoreResult, score_batch

__all__ = ["BUILTIN_REWARDS", "RewardLoadError", "ScoreResult", "load_reward_fn", "score_batch"]
