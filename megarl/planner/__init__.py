"""Before launch: will the job fit? Per-rank memory per phase (megarl.planner.memory) and the report, verdict and
weight-sync estimate of `megarl plan` (megarl.planner.job)."""

from megarl.planner.job import Hardware, JobPlan, PlanError, default_hardware, format_plan, make_plan, verdict_line

__all__ = ["Hardware", "JobPlan", "PlanError", "default_hardware", "format_plan", "make_plan", "verdict_line"]
