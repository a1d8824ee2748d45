"""Mini-batch PPO-style updates and forward passes over a step's samples, for any layout.

The step's N sequences are known on every rank in one global order. Mini-batch ``k`` is the sequences
``[k*G, (k+1)*G)`` (G = global_batch_size), so the set of sequences in each optimizer step does not depend on the
layout. Each mini-batch is shared out over the DP ranks by tokens and each share packed by length
(``megarl.backend.batch.plan``: a pure function of the lengths, the same on every rank). Forward-only passes (old /
reference log-probs, values) run on each DP rank's share of every mini-batch and are gathered over DP, so every rank
ends with the whole batch's values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megarl.backend.batch import Batching, PackStats, Sequence, micro_batches, plan, response_values
from megarl.backend.logprobs import forward_per_token
from megarl.backend.losses import GlobalNorm
from megarl.backend.moe import LoadBalancing, RoutingReplay
from megarl.backend.step import SUM, NonFiniteUpdate, train_step


def minibatch_rows(num_seqs: int, global_batch_size: int) -> list[range]:
    """Global sequence indices of each mini-batch (the last one may be shorter)."""
    return [range(i, min(i + global_batch_size, num_seqs)) for i in range(0, num_seqs, global_batch_size)]


def _dp_coords() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def _lockstep() -> bool:
    """Whether the DP ranks must run equally many micro-batches: an expert-parallel group's dispatch is a collective
    in every forward and backward."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_world_size() > 1


def minibatch_plan(seqs: list[Sequence], rows: range, batching: Batching) -> list[list[list[int]]]:
    """Mini-batch ``rows``' micro-batches on each DP rank, as groups of global sequence indices (``plan``)."""
    _, dp = _dp_coords()
    per_rank = plan([len(seqs[i].tokens) - 1 for i in rows], dp, batching, lockstep=_lockstep())
    return [[[rows[j] for j in g] for g in groups] for groups in per_rank]


def _count(stats: PackStats | None, seqs: list[Sequence], per_rank: list[list[list[int]]]) -> None:
    """One pass over a mini-batch's micro-batches on every DP rank, into ``stats``."""
    if stats is not None:
        positions = {i: len(seqs[i].tokens) - 1 for groups in per_rank for g in groups for i in g}
        for groups in per_rank:
            stats.count(groups, positions)


def forward_fields(model, seqs: list[Sequence], per_token: Callable, batching: Batching,
                   stats: PackStats | None = None, replay: RoutingReplay | None = None
                   ) -> list[torch.Tensor]:  # fmt: skip
    """Collective over the world: ``per_token`` (micro-batch, model output) -> [b, S] for every sequence, read back
    response-aligned; each DP rank computes its share and the results are gathered over DP. ``replay``: the
    sequences' routes replayed (or measured) in the model's routers."""
    from megatron.core import parallel_state as ps

    dp_rank, dp = _dp_coords()
    groups = []
    for rows in minibatch_rows(len(seqs), batching.global_batch_size):
        per_rank = minibatch_plan(seqs, rows, batching)
        _count(stats, seqs, per_rank)
        groups += per_rank[dp_rank]
    computed: dict[int, torch.Tensor] = {}
    if groups:
        values = forward_per_token(model, micro_batches(seqs, groups), per_token, replay)
        for values_BS, group in zip(values, groups):
            for i, v in zip(group, response_values(values_BS, [seqs[i] for i in group])):
                computed[i] = v
    if dp > 1:
        parts = [None] * dp
        dist.all_gather_object(parts, computed, group=ps.get_data_parallel_group())
        computed = {k: v for part in parts for k, v in part.items()}
    return [computed[i] for i in range(len(seqs))]


def ppo_updates(
    model,
    optimizer,
    seqs: list[Sequence],
    fields: dict[str, list[torch.Tensor]],
    make_loss: Callable[[GlobalNorm], Callable],
    batching: Batching,
    *,
    epochs: int,
    norm_len: int,
    scheduler=None,
    trained: list[bool] | None = None,
    stats: PackStats | None = None,
    balancing: LoadBalancing | None = None,
    replay: RoutingReplay | None = None,
) -> dict[str, float]:
    """Collective: ``epochs`` passes of one optimizer step per mini-batch (``scheduler`` stepped before each).
    ``trained`` (default: all) marks the sequences in the loss: the others leave ``loss_mask`` and the global token
    and sequence counts (rejection sampling), though they stay in the micro-batches. Returns the metrics averaged
    over the optimizer steps (``max/`` keys: the maximum), with ``grad_norm`` and ``lr``. A non-finite step raises
    ``NonFiniteUpdate`` (the scheduler is stepped back; the steps before it stay applied) and ends this update.

    A mini-batch with no trained sequence takes no optimizer and no scheduler step (a zero gradient would still move
    Adam's moments and apply weight decay); ``empty_minibatches`` counts them. ``trained`` is the same on every
    rank, so every DP and PP rank skips the same mini-batches without a collective. The loss's denominators are the
    mini-batch's (``GlobalNorm``), so the update does not depend on how its sequences are shared out and packed.
    ``balancing`` (a routed-expert model's): its term weighed to the mean over each mini-batch's micro-batches, and
    ``moe/aux_loss``, the unscaled loss's mean over this update's micro-batches and routed layers. ``replay``: the
    sequences' routes in the routers (``forward_fields``), and ``moe/routing_agreement`` over every forward since
    its last reading (the old log-probs' and this update's)."""
    dp_rank, dp = _dp_coords()
    trained = trained if trained is not None else [True] * len(seqs)
    history: list[dict] = []
    empty = 0
    all_rows = minibatch_rows(len(seqs), batching.global_batch_size)
    minibatches = [(rows, minibatch_plan(seqs, rows, batching)) for rows in all_rows]  # the same in every epoch
    for _ in range(epochs):
        for rows, per_rank in minibatches:
            if not any(trained[i] for i in rows):
                empty += 1
                continue
            _count(stats, seqs, per_rank)
            batches = _trained_micro_batches(seqs, fields, per_rank[dp_rank], trained)
            if balancing is not None:  # lockstep fillers carry no term
                balancing.scale = len(batches) * dp / sum(1 for groups in per_rank for g in groups if g)
            norm = GlobalNorm(
                tokens=sum(seqs[i].loss_tokens for i in rows if trained[i]),
                seqs=sum(trained[i] for i in rows),
                norm_len=norm_len,
                scale=float(len(batches) * dp),
            )
            if scheduler is not None:
                scheduler.step(1)
            try:
                history.append(train_step(model, optimizer, batches, make_loss(norm), reduce=SUM, replay=replay))
            except NonFiniteUpdate:
                if scheduler is not None:
                    scheduler.step(-1)
                raise
    return {**_averaged(history), **_routed_metrics(balancing, replay), "empty_minibatches": float(empty)}


def _routed_metrics(balancing: LoadBalancing | None, replay: RoutingReplay | None) -> dict[str, float]:
    """Collective: a routed-expert model's ``moe/`` metrics since their last reading."""
    metrics = {}
    if balancing is not None:
        metrics["moe/aux_loss"] = balancing.take()
    if replay is not None:
        metrics.update(replay.take())
    return metrics


def _averaged(history: list[dict]) -> dict[str, float]:
    """Each metric's mean over the optimizer steps (``max/`` keys: the maximum)."""
    keys = history[0].keys() if history else ()
    return {
        k: max(h[k] for h in history) if k.startswith("max/") else sum(h[k] for h in history) / len(history)
        for k in keys
    }


def _trained_micro_batches(seqs: list[Sequence], fields: dict, groups: list[list[int]], trained: list[bool]
                           ) -> list[dict]:  # fmt: skip
    """This rank's micro-batches ``groups`` (global indices) of a mini-batch, the sequences not ``trained`` out of the
    loss mask."""
    batches = micro_batches(seqs, groups, fields)
    for batch, group in zip(batches, groups):
        if group:
            batch["loss_mask"] *= torch.tensor([float(trained[i]) for i in group]).unsqueeze(1)
    return batches
