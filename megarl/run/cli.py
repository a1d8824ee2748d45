"""`megarl train`: the recipe checked before any process starts (no torch, megatron-core or vLLM is loaded until its
checks pass: a bad recipe is one line), then the run in this process (one rank), under torchrun (several ranks on
this node) or as one of torchrun's ranks (``megarl.run.rank``)."""

from __future__ import annotations

import contextlib
import os
import sys

from megarl import faults
from megarl.checkpoint.locate import checkpoints_root, finish_interrupted_saves
from megarl.compat.host_memory import HUGE_PAGES_ENV
from megarl.config import ConfigError, validate
from megarl.config.device_defaults import on_cuda
from megarl.config.loader import load_config_and_defaults
from megarl.config.validate import launch_world_size
from megarl.lifetime import supervise
from megarl.run.preflight import check_inputs
from megarl.run.resume import EXIT_PREEMPTED, STOPPED_FILE, ResumeError, RunComplete, plan_start


def train_command(args, stop=None) -> int:
    """`megarl train`: check the recipe, then train here (one rank), relaunch under torchrun (several), or run as one
    of torchrun's ranks (``stop``: its stop requests, installed first of all by ``megarl.cli``)."""
    launched = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    checked = _checked_recipe(args, launched)
    if isinstance(checked, int):
        return checked
    cfg, chosen, spec = checked
    if args.dry_run:
        return _dry_run(cfg, spec)
    stopped = os.path.join(cfg.trainer.output_dir, STOPPED_FILE)
    if launched is None and launch_world_size(cfg) > 1:
        cpu_ranks = cfg.trainer.keep_freed_memory and not on_cuda()
        env = {**HUGE_PAGES_ENV, **os.environ} if cpu_ranks else None  # read by torch when a rank starts
        rc = _relaunch_under_torchrun(launch_world_size(cfg), ["train", args.config, *args.overrides], env=env)
        return EXIT_PREEMPTED if rc == 0 and os.path.isfile(stopped) else rc
    from megarl.run.rank import train_checked  # here: a config error or a relaunch does not import the trainer

    return train_checked(cfg, spec, chosen, stop)


def _checked_recipe(args, launched: int | None):
    """The recipe with its overrides, validated (for ``launched`` ranks), its inputs checked and where it starts
    planned (once, before any process starts): (config, device choices, model spec), or the exit status after one
    line."""
    try:
        cfg, chosen = load_config_and_defaults(args.config, args.overrides)
        spec = validate(cfg, world_size=launched)
        if launched is None:  # once, before any process starts (not again on every launched rank)
            check_inputs(cfg)
            faults.planned()
    except (ConfigError, ValueError) as e:
        print(f"megarl: config error: {e}", file=sys.stderr)
        return 2
    if launched is None and not args.dry_run:
        try:
            with contextlib.suppress(OSError):  # a publish a kill cut, as build_job does (unwritable: plan_start says)
                for line in finish_interrupted_saves(checkpoints_root(cfg.trainer.output_dir)):
                    print(f"[megarl] {line}", flush=True)
            plan_start(cfg, spec)  # resume target, same model, writable output_dir: before any process starts
        except RunComplete as e:
            print(f"[megarl] {e}", flush=True)
            return 0
        except ResumeError as e:
            print(f"megarl: {e}", file=sys.stderr)
            return 2
    return cfg, chosen, spec


def _dry_run(cfg, spec) -> int:
    """`megarl train --dry-run`: what would run, and the memory plan's verdict."""
    from megarl.planner.job import PlanError, plan_for, verdict_line  # here: after the checks (the planner loads
    # torch)

    par = cfg.actor.parallel
    print(
        f"[megarl] dry run: config, model ({spec.family} {spec.num_layers}x{spec.hidden_size}), data and reward "
        f"are valid; {cfg.algorithm.adv_estimator} at TP={par.tp} PP={par.pp} DP={par.dp} (world "
        f"{launch_world_size(cfg)}) would write to {cfg.trainer.output_dir}"
    )
    try:
        print(f"[megarl] {verdict_line(plan_for(cfg, spec, sync=False))}")
    except PlanError as e:
        print(f"[megarl] memory plan: {e}")
    return 0


def _relaunch_under_torchrun(nproc: int, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Start ``nproc`` local ranks of this same command (single node), in ``env`` (None: this process's).
    Multi-node jobs use ``megarl launch``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "megarl.cli",
        *argv,
    ]
    print(f"[megarl] launching {nproc} local ranks: {' '.join(cmd[1:])}", flush=True)
    return supervise(cmd, env=env)  # a SIGTERM/SIGUSR1 goes to the ranks: they stop after a save
