"""Before launch: will the job fit? Per-rank memory per phase (megarl.planner.memory) and the report, verdict and
weight-sync estimate of `megarl plan` (megarl.planner.job). Its modules are imported by name: `megarl plan` checks
the recipe (``megarl.planner.cli``) before the planner, which loads torch, is imported."""
