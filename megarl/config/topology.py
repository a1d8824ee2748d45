"""What both launchers check before anything starts: the recipe's TP x PP x DP layout against nodes x ranks per node.

torchrun numbers ranks node by node (a block of ``ranks_per_node`` consecutive ranks per node) and Megatron puts TP
innermost (``ParallelLayout``), so a TP group stays inside a node exactly when the layout says so.
"""

from __future__ import annotations

import os

from megarl.config import MegarlConfig
from megarl.config.validate import divisors, launch_world_size, layout_config, pool_layout_role, pools_of, rollout_tp
from megarl.parallel.layout import ParallelLayout


class LaunchError(ValueError):
    """A launch that cannot work; the message names the option and the fix."""


def recipe_layout(cfg: MegarlConfig, ranks_per_node: int | None = None) -> ParallelLayout:
    par = cfg.actor.parallel
    return ParallelLayout.of(par, ranks_per_node)


def check_nodes(cfg: MegarlConfig, nnodes: int, ranks_per_node: int, nodes_opt: str, ranks_opt: str) -> None:
    """Refuse a node count or size the recipe's layout cannot use; ``*_opt`` name the options in messages."""
    layout = recipe_layout(cfg, ranks_per_node)
    launched = nnodes * ranks_per_node
    if pools_of(cfg):
        _check_pool_nodes(cfg, launched, ranks_per_node, nodes_opt, ranks_opt)
        return
    if launched != layout.world_size:
        raise LaunchError(
            f"{nodes_opt} {nnodes} x {ranks_opt} {ranks_per_node} = {launched} ranks, but the recipe's actor.parallel "
            f"tp={layout.tp} x pp={layout.pp} x dp={layout.dp} needs {layout.world_size}: change "
            f"{nodes_opt}/{ranks_opt} or actor.parallel.{{tp,pp,dp}}"
        )
    if not layout.tp_groups_within_nodes():
        spanning = next(g for g in layout.tp_groups() if len({layout.node(r) for r in g}) > 1)
        raise LaunchError(
            f"actor.parallel.tp={layout.tp} with {ranks_opt} {ranks_per_node}: the TP group of ranks {spanning} would "
            f"span nodes {sorted({layout.node(r) for r in spanning})}; use a tp that divides {ranks_opt} "
            f"({divisors(ranks_per_node)}) and raise dp or pp instead"
        )


def _check_pool_nodes(cfg: MegarlConfig, launched: int, ranks_per_node: int, nodes_opt: str, ranks_opt: str) -> None:
    """Resource pools: the launch is every pool's ranks; each pool's TP groups (its Megatron layout, offset to the
    pool's first rank; the rollout engines, blocks of rollout.tp) stay inside a node."""
    world = launch_world_size(cfg)
    if launched != world:
        raise LaunchError(
            f"{nodes_opt} x {ranks_opt} = {launched} ranks, but placement.pools cover {world}: change "
            f"{nodes_opt}/{ranks_opt} or the pools' ranks"
        )
    for pool in pools_of(cfg):
        role = pool_layout_role(pool)
        if role is not None:  # Megatron's layout of the pool (the actor's, the critic's, the reward model's)
            par = layout_config(cfg, role)
            layout = ParallelLayout.of(par)
            groups = [[pool.ranks.start + r for r in g] for g in layout.tp_groups()]
        elif "rollout" in pool.roles:
            tp = rollout_tp(cfg)
            groups = [list(pool.ranks[i : i + tp]) for i in range(0, pool.size, tp)]
        else:
            groups = []
        for g in groups:
            nodes = sorted({r // ranks_per_node for r in g})
            if len(nodes) > 1:
                raise LaunchError(
                    f"placement.pools.{pool.name}: the TP group of ranks {g} would span nodes {nodes} with "
                    f"{ranks_opt} {ranks_per_node}; start the pool at a node boundary or use a smaller tp"
                )


def positive(value: int, option: str) -> None:
    if value < 1:
        raise LaunchError(f"{option} must be >= 1, got {value}")


def train_args(recipe: str, overrides: list[str]) -> list[str]:
    """``python -m megarl.cli`` arguments of one rank: the recipe by absolute path (ranks may start elsewhere)."""
    return ["-m", "megarl.cli", "train", os.path.abspath(recipe), *overrides]

