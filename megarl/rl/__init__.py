"""The RL step: a batch from the feed (synchronous, one-step-off or bounded), rewards, old / reference log-probs and
values, advantages, the updates, the weight push and the step's metrics; the roles that do the model work."""
