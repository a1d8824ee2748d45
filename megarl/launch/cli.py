"""Command lines of ``megarl launch torchrun`` and ``megarl launch slurm`` (options intermixed with overrides)."""

from __future__ import annotations

import argparse
import sys

from megarl.config import ConfigError
from megarl.config.topology import LaunchError
from megarl.launch import slurm, torchrun


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe, e.g. configs/qwen2.5_7b_grpo_gsm8k.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every rank, e.g. trainer.total_steps=100")


def _strict_paths(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--strict-paths", action="store_true",
        help="refuse paths this host cannot see (e.g. a cluster's /data) instead of warning about them",
    )  # fmt: skip


def torchrun_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megarl launch torchrun",
        description="run on every node with its --node-rank: torchrun with a static rendezvous at --master-addr, "
        "each rank running `megarl train RECIPE overrides`",
    )
    _recipe_args(p)
    p.add_argument("--nnodes", type=int, required=True, help="number of nodes")
    p.add_argument("--node-rank", type=int, required=True, help="this node's index, 0 on the --master-addr node")
    p.add_argument("--master-addr", required=True, help="hostname or IP of node 0, reachable from every node")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0 (default 29500)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="ranks (GPUs) per node (default: world / nnodes)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    _strict_paths(p)
    return p


def slurm_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megarl launch slurm",
        description="write an sbatch script (one task per node running torchrun, preemption -> save -> requeue); "
        "printed, or submitted with --submit",
    )
    _recipe_args(p)
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node, one per GPU")
    p.add_argument("--cpu", action="store_true", help="request no GPUs: the ranks run on CPU (gloo), for tests")
    p.add_argument("--cpus-per-node", type=int, default=None, help="CPUs of the node task (default: whole nodes)")
    p.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's)")
    p.add_argument("--account", default=None, help="SLURM account (default: yours)")
    p.add_argument("--time", default=None, help="time limit, e.g. 04:00:00 (default: the partition's)")
    p.add_argument("--output", dest="log_dir", default=None, help="log folder (default: <trainer.output_dir>/slurm)")
    p.add_argument("--env-file", default=None, help="per-cluster KEY=VALUE lines, e.g. launch/clusters/example.env")
    p.add_argument("--job-name", default=None, help="job name (default: megarl-<recipe name>)")
    p.add_argument("--rdzv-port", type=int, default=29500, help="c10d rendezvous port on the first node")
    p.add_argument("--signal-secs", type=int, default=None,
                   help="SIGUSR1 this long before the time limit (s); default: from the plan (an update + sync + "
                        "trainer.stop_grace_s + a save), at least 300")  # fmt: skip
    p.add_argument("--fs-gb-s", type=float, default=2.0,
                   help="checkpoint filesystem GB/s per node, for the derived signal lead (default 2)")  # fmt: skip
    p.add_argument("--submit", action="store_true", help="write the script to the log folder and sbatch it")
    _strict_paths(p)
    net = p.add_argument_group("NCCL / InfiniBand (override --env-file)")
    net.add_argument("--nccl-ib-hca", default=None, help="NCCL_IB_HCA, e.g. mlx5")
    net.add_argument("--nccl-socket-ifname", default=None, help="NCCL_SOCKET_IFNAME, e.g. ib0")
    net.add_argument("--nccl-ib-gid-index", type=int, default=None, help="NCCL_IB_GID_INDEX, e.g. 3 (RoCE v2)")
    net.add_argument("--nccl-debug", default=None, help="NCCL_DEBUG (default WARN)")
    net.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="any other variable; repeatable")
    return p


def _torchrun(argv: list[str]) -> int:
    a = torchrun_parser().parse_intermixed_args(argv)
    opts = torchrun.TorchrunOptions(
        recipe=a.recipe, overrides=a.overrides, nnodes=a.nnodes, node_rank=a.node_rank, master_addr=a.master_addr,
        master_port=a.master_port, nproc_per_node=a.nproc_per_node, dry_run=a.dry_run, strict_paths=a.strict_paths,
    )  # fmt: skip
    return torchrun.launch(opts)


def _slurm(argv: list[str]) -> int:
    a = slurm_parser().parse_intermixed_args(argv)
    network = slurm.NetworkEnv(
        nccl_ib_hca=a.nccl_ib_hca, nccl_socket_ifname=a.nccl_socket_ifname, nccl_ib_gid_index=a.nccl_ib_gid_index,
        nccl_debug=a.nccl_debug, extra=a.env,
    )  # fmt: skip
    opts = slurm.SlurmOptions(
        recipe=a.recipe, overrides=a.overrides, nodes=a.nodes, gpus_per_node=a.gpus_per_node, cpu=a.cpu,
        cpus_per_node=a.cpus_per_node, partition=a.partition, account=a.account, time=a.time, log_dir=a.log_dir,
        env_file=a.env_file, network=network, job_name=a.job_name, rdzv_port=a.rdzv_port,
        signal_secs=a.signal_secs, fs_gb_s=a.fs_gb_s, submit=a.submit, strict_paths=a.strict_paths,
    )  # fmt: skip
    return slurm.launch(opts)


LAUNCHERS = {"torchrun": _torchrun, "slurm": _slurm}


def main(launcher: str, argv: list[str]) -> int:
    """Run one launcher; a config or launch error is one line on stderr and exit status 2."""
    try:
        return LAUNCHERS[launcher](argv)
    except ConfigError as e:
        print(f"megarl: launch {launcher}: config error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"megarl: launch {launcher}: {e}", file=sys.stderr)
        return 2
