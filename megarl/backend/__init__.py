"""Megatron machinery under the RL step: the models of a run, DDP and optimizer set-up, micro-batches, the forward and
backward schedule, loss functions, log-probs and offload. Knows nothing of rollout or of the RL loop."""
