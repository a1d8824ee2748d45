"""``megarl launch torchrun``: run the same command on every node, each with its ``--node-rank``. torchrun's static
rendezvous at ``--master-addr`` gives node R the ranks R*G .. R*G+G-1 (G = ``--nproc-per-node``), and every rank
runs ``python -m megarl.cli train RECIPE overrides`` (the trainer reads the node size from ``LOCAL_WORLD_SIZE``)."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field

from megarl import lifetime
from megarl.config import MegarlConfig, load_config
from megarl.config.topology import LaunchError, check_nodes, positive, train_args
from megarl.config.validate import launch_world_size
from megarl.run.preflight import preflight
from megarl.run.resume import EXIT_PREEMPTED, STOPPED_FILE


@dataclass(kw_only=True)
class TorchrunOptions:
    """One node's share of a multi-node run."""

    recipe: str
    """YAML recipe every rank trains."""
    overrides: list[str] = field(default_factory=list)
    """``key.sub=value`` overrides passed to every rank."""
    nnodes: int
    """Number of nodes in the run."""
    node_rank: int
    """This node's index, 0 .. nnodes-1; node 0 hosts the rendezvous and holds ranks 0 .. G-1."""
    master_addr: str
    """Hostname or IP address of node 0, reachable from every node."""
    master_port: int = 29500
    """TCP port of the rendezvous on node 0."""
    nproc_per_node: int | None = None
    """Ranks (one per GPU) on every node; None: the recipe's world size divided by ``nnodes``."""
    dry_run: bool = False
    """Print the torchrun command instead of running it."""
    strict_paths: bool = False
    """Refuse paths this host cannot see (model, data, reward file) instead of warning about them."""

    def __post_init__(self):
        positive(self.nnodes, "--nnodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(
                f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} (--nnodes {self.nnodes}); give each "
                "node its own index, 0 on the --master-addr node"
            )
        if not self.master_addr:
            raise LaunchError("--master-addr is empty: give the hostname or IP of node 0")
        if not 1 <= self.master_port <= 65535:
            raise LaunchError(f"--master-port {self.master_port} is not a TCP port (1..65535)")
        if self.nproc_per_node is not None:
            positive(self.nproc_per_node, "--nproc-per-node")


def ranks_per_node(opts: TorchrunOptions, cfg: MegarlConfig) -> int:
    if opts.nproc_per_node is not None:
        return opts.nproc_per_node
    world = launch_world_size(cfg)
    if world % opts.nnodes:
        raise LaunchError(
            f"--nnodes {opts.nnodes} does not divide the {world} ranks of the recipe (actor.parallel, or "
            "placement.pools): change --nnodes, give --nproc-per-node, or change the layout"
        )
    return world // opts.nnodes


def torchrun_command(opts: TorchrunOptions, cfg: MegarlConfig, python: str = sys.executable) -> list[str]:
    """This node's torchrun command line, after refusing a layout the nodes cannot hold."""
    nproc = ranks_per_node(opts, cfg)
    check_nodes(cfg, opts.nnodes, nproc, "--nnodes", "--nproc-per-node")
    return [
        python, "-m", "torch.distributed.run", f"--nnodes={opts.nnodes}", f"--node-rank={opts.node_rank}",
        f"--nproc-per-node={nproc}", f"--master-addr={opts.master_addr}", f"--master-port={opts.master_port}",
        *train_args(opts.recipe, opts.overrides),
    ]  # fmt: skip


def launch(opts: TorchrunOptions) -> int:
    """Check, then run (or print) this node's torchrun; ``EXIT_PREEMPTED`` when the ranks stopped after a save."""
    cfg = load_config(opts.recipe, opts.overrides)
    cmd = torchrun_command(opts, cfg)
    for warning in preflight(cfg, opts.nnodes * ranks_per_node(opts, cfg), strict_paths=opts.strict_paths):
        print(f"megarl: launch torchrun: warning: {warning}", file=sys.stderr)
    if opts.dry_run:
        print(shlex.join(cmd))
        return 0
    print(f"[megarl] node {opts.node_rank}/{opts.nnodes}: {shlex.join(cmd)}", flush=True)
    rc = lifetime.supervise(cmd, label=f"node {opts.node_rank}")
    stopped = os.path.isfile(os.path.join(cfg.trainer.output_dir, STOPPED_FILE))
    return EXIT_PREEMPTED if rc == 0 and stopped else rc
