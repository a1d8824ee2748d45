"""`megarl plan`: will the job fit? The recipe planned for GPUs (from any machine) on the hardware the options
name; exit status 0 when it fits, 1 when it does not, 2 for a bad recipe."""

from __future__ import annotations

import sys

from megarl.config import ConfigError, load_config, validate
from megarl.planner import PlanError, default_hardware, format_plan, make_plan


def plan_for(cfg, spec, args=None, sync: bool = True):
    """The plan of ``cfg`` on the hardware ``args`` names (defaults for what it does not; None: all defaults)."""
    par = cfg.actor.parallel
    hw = default_hardware(
        par.tp * par.pp * par.dp,
        getattr(args, "nodes", None),
        getattr(args, "gpus_per_node", None),
        gpu_mem_gb=getattr(args, "gpu_mem_gb", None),
        ib_gbps=getattr(args, "ib_gbps", None),
        nvlink_gbps=getattr(args, "nvlink_gbps", None),
        peak_tflops=getattr(args, "peak_tflops", None),
        hbm_gb_s=getattr(args, "hbm_gb_s", None),
        fs_gb_s=getattr(args, "fs_gb_s", None),
    )
    return make_plan(cfg, spec, hw, sync=sync)


def plan_command(args) -> int:
    """`megarl plan RECIPE [overrides] [hardware options]`: the report, and whether the job fits."""
    try:
        cfg = load_config(args.config, args.overrides, cuda=True)  # planned for GPUs, from any machine
        spec = validate(cfg)
        job = plan_for(cfg, spec, args)
    except (ConfigError, PlanError, ValueError) as e:
        print(f"megarl: {e}", file=sys.stderr)
        return 2
    print(format_plan(job))
    return 0 if job.fits else 1
