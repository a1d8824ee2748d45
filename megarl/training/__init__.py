"""Megatron-side training machinery: DDP + optimizer setup and one step over micro-batches. The RL loop builds on it."""
