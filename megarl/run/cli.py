"""`megarl train`: the recipe checked before any process starts, then the run in this process (one rank), under
torchrun (several ranks on this node) or as one of torchrun's ranks, with one line and an exit status for what ends it
(``EXIT_PREEMPTED`` after a stop with a checkpoint: requeue)."""

from __future__ import annotations

import functools
import os
import sys

from megarl import faults, lifetime
from megarl.compat.host_memory import HUGE_PAGES_ENV
from megarl.config import ConfigError, validate
from megarl.config.device_defaults import apply_tf32, on_cuda
from megarl.config.loader import load_config_and_defaults
from megarl.config.validate import launch_world_size
from megarl.lifetime import supervise
from megarl.models.source import model_source
from megarl.parallel.init import describe_collective_timeout
from megarl.parallel.spawn import run_on_ranks
from megarl.planner import PlanError, verdict_line
from megarl.planner.cli import plan_for
from megarl.rewards import RewardFailure
from megarl.rl.collect import DynamicSamplingExhausted
from megarl.run.preemption import installed_stop_requests
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
    from megarl.run.train import train  # here: a config error or a relaunch does not import the whole trainer

    source = model_source(cfg.model.path)
    _device_defaults(chosen, say=os.environ.get("RANK", "0") == "0")
    if launched is not None:
        return run_rank(functools.partial(train, stop=stop), cfg, spec, source)  # a rank under torchrun: the
        # relaunching parent reports a stop
    return _train_here(train, cfg, spec, source, stopped)


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


def _train_here(train, cfg, spec, source, stopped: str) -> int:
    """One rank, in this process: 0 after a clean end, 1 with one line for a run that cannot go on, EXIT_PREEMPTED
    after a stop."""
    lifetime.forks_die_with_this_process()  # this process is the rank: what it forks dies with it
    stop = installed_stop_requests()
    try:
        in_here = "RANK" not in os.environ  # run_on_ranks runs it in this process (else it spawns one)
        run_on_ranks(functools.partial(train, stop=stop) if in_here else train, 1, cfg, spec, source)
    except RunComplete as e:
        print(f"[megarl] {e}", flush=True)
        return 0
    except (RewardFailure, DynamicSamplingExhausted, ResumeError) as e:
        print(f"megarl: {e}", file=sys.stderr, flush=True)
        return 1
    return EXIT_PREEMPTED if os.path.isfile(stopped) else 0


def _device_defaults(chosen: list[str], say: bool) -> None:
    """The training process's device settings: TF32 on CUDA, and one line naming what 'auto' chose."""
    chosen = chosen + apply_tf32(on_cuda())
    if say and chosen:
        print(f"[megarl] device defaults ({'cuda' if on_cuda() else 'cpu'}): {', '.join(chosen)}", flush=True)


def run_rank(train, *args) -> int:
    """One torchrun rank's run: 0 after a clean end (also a stop after a save); 1 with one line when a collective
    timed out (a peer died or hangs), or with rank 0's account of a broken reward function (every rank stops on the
    same gathered scores); any other error propagates (its traceback is the report)."""
    try:
        train(*args)
    except RunComplete as e:  # a requeued job whose run already ended: completed, not failed
        if os.environ.get("RANK", "0") == "0":
            print(f"[megarl] {e}", flush=True)
        lifetime.finish_rank()
        return 0
    except (RewardFailure, DynamicSamplingExhausted, ResumeError) as e:  # decided on gathered data: all ranks alike
        if os.environ.get("RANK", "0") == "0":
            print(f"megarl: {e}", file=sys.stderr, flush=True)
        lifetime.finish_rank()  # an agreed stop, not a death: the other ranks are not killed
        return 1
    except RuntimeError as e:
        line = describe_collective_timeout(e)
        if line is None:
            raise
        print(f"megarl: rank {os.environ.get('RANK', '0')}: {line}", file=sys.stderr, flush=True)
        return 1
    lifetime.finish_rank()
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
