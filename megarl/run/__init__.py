"""A run's life (`megarl train`): building the job, the steps' cadence, validation, saves, resume, faults and
preemption. Calls the step (``megarl.rl``); the step never calls back into it."""
