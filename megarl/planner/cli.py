"""`megarl plan`: will the job fit? The recipe planned for GPUs (from any machine) on the hardware the options
name; exit status 0 when it fits, 1 when it does not, 2 for a bad recipe."""

from __future__ import annotations

import sys

from megarl.config import ConfigError, load_config, validate

HARDWARE_OPTIONS = ("nodes", "gpus_per_node", "gpu_mem_gb", "ib_gbps", "nvlink_gbps", "peak_tflops", "hbm_gb_s",
                    "fs_gb_s")  # fmt: skip
"""`megarl plan`'s hardware options (``megarl.cli``), each positive when given."""


def plan_command(args) -> int:
    """`megarl plan RECIPE [overrides] [hardware options]`: the report, and whether the job fits."""
    try:
        cfg = load_config(args.config, args.overrides, cuda=True)  # planned for GPUs, from any machine
        spec = validate(cfg)
        for option in HARDWARE_OPTIONS:
            value = getattr(args, option, None)
            if value is not None and not value > 0:
                raise ValueError(f"--{option.replace('_', '-')} must be positive, got {value}")
    except (ConfigError, ValueError) as e:
        print(f"megarl: {e}", file=sys.stderr)
        return 2
    from megarl.planner.job import format_plan, plan_for  # here: after the recipe's checks (the planner loads torch)

    try:
        job = plan_for(cfg, spec, args)
    except ValueError as e:  # PlanError, or hardware options no layout takes (--gpus-per-node -1)
        print(f"megarl: {e}", file=sys.stderr)
        return 2
    print(format_plan(job))
    return 0 if job.fits else 1
