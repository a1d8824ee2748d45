"""Reward shaping applied by the trainer after the reward function (DAPO's soft overlong punishment)."""

from __future__ import annotations


def overlong_penalty(length: int, max_new_tokens: int, buffer_len: int, penalty_factor: float) -> float:
    """0 up to ``max_new_tokens - buffer_len`` tokens, then a linear ramp down to ``-penalty_factor`` at
    ``max_new_tokens`` (DAPO, eq. 13)."""
    free = max_new_tokens - buffer_len
    if length <= free:
        return 0.0
    return -penalty_factor * min(length - free, buffer_len) / buffer_len
