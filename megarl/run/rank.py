"""`megarl train` once its recipe passed the checks: the run in this process (one rank) or as one of torchrun's
ranks, with one line and an exit status for what ends it (``EXIT_PREEMPTED`` after a stop with a checkpoint)."""

from __future__ import annotations

import functools
import os
import sys

from megarl import lifetime
from megarl.compat import quiet
from megarl.config.device_defaults import apply_tf32, on_cuda
from megarl.models.source import model_source
from megarl.parallel.init import describe_collective_timeout
from megarl.parallel.spawn import run_on_ranks
from megarl.rewards import RewardFailure
from megarl.rl.collect import DynamicSamplingExhausted
from megarl.run.preemption import installed_stop_requests
from megarl.run.resume import EXIT_PREEMPTED, STOPPED_FILE, ResumeError, RunComplete
from megarl.run.train import train


def train_checked(cfg, spec, chosen: list[str], stop=None) -> int:
    """Train the checked recipe ``cfg`` here, or as a torchrun rank (``stop``: its stop requests, installed first of
    all by ``megarl.cli``); ``chosen``: the device defaults the loader chose, said once."""
    source = model_source(cfg.model.path)
    _start_up_lines(cfg, chosen, say=os.environ.get("RANK", "0") == "0")
    if "WORLD_SIZE" in os.environ:
        return run_rank(functools.partial(train, stop=stop), cfg, spec, source)  # a rank under torchrun: the
        # relaunching parent reports a stop
    return _train_here(cfg, spec, source, os.path.join(cfg.trainer.output_dir, STOPPED_FILE))


def _train_here(cfg, spec, source, stopped: str) -> int:
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


def _start_up_lines(cfg, chosen: list[str], say: bool) -> None:
    """The training process's device settings (TF32 on CUDA), and the lines that name what 'auto' chose and which
    implementations run (megatron-core's own warnings about them are silenced: ``megarl.compat.quiet``)."""
    cuda = on_cuda()
    chosen = chosen + apply_tf32(cuda)
    if not cuda:
        quiet.install_for_cpu()
    if say and chosen:
        print(f"[megarl] device defaults ({'cuda' if cuda else 'cpu'}): {', '.join(chosen)}", flush=True)
    if say:
        print(f"[megarl] implementations: {quiet.implementations(cfg.model.transformer_impl)}", flush=True)


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
