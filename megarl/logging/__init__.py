"""Metrics sinks (rank 0): console + progress bar, metrics.jsonl, W&B, and the reward-curve PNG."""

from megarl.logging.jsonl import JsonlWriter, read_metrics
from megarl.logging.plot import plot_from_dir, plot_reward_curve
from megarl.logging.tracker import Tracker

__all__ = ["JsonlWriter", "Tracker", "plot_from_dir", "plot_reward_curve", "read_metrics"]
