"""The RL loop (`megarl train`): job setup, rollout + rewards, the update, metrics, per-phase timers."""
