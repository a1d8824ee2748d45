"""Mini-batch PPO-style updates and forward passes over a step's samples, for any layout.

The step's N sequences are known on every rank in one global order. Mini-batch ``k`` is the sequences
``[k*G, (k+1)*G)`` (G = global_batch_size), split contiguously over the DP ranks, so the set of sequences in each
optimizer step does not depend on the layout. Forward-only passes (old / reference log-probs, values) run on each DP
rank's share of every mini-batch and are gathered over DP, so every rank ends with the whole batch's values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megarl.backend.batch import Sequence, micro_batches, response_values
from megarl.backend.logprobs import forward_per_token
from megarl.backend.losses import GlobalNorm
from megarl.backend.step import SUM, NonFiniteUpdate, train_step
from megarl.parallel.layout import prompt_slice


def minibatch_rows(num_seqs: int, global_batch_size: int) -> list[range]:
    """Global sequence indices of each mini-batch (the last one may be shorter)."""
    return [range(i, min(i + global_batch_size, num_seqs)) for i in range(0, num_seqs, global_batch_size)]


def dp_rows(rows: range, dp_rank: int, dp: int) -> list[int]:
    """This DP rank's contiguous share of a mini-batch."""
    share = prompt_slice(len(rows), dp_rank, dp)
    return [rows[i] for i in share]


def _dp_coords() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def forward_fields(
    model,
    seqs: list[Sequence],
    per_token: Callable,
    *,
    global_batch_size: int,
    max_tokens: int,
    micro_batch_size: int,
) -> list[torch.Tensor]:
    """Collective over the world: ``per_token`` (micro-batch, model output) -> [b, S] for every sequence, read back
    response-aligned; each DP rank computes its share and the results are gathered over DP."""
    from megatron.core import parallel_state as ps

    dp_rank, dp = _dp_coords()
    mine = [i for rows in minibatch_rows(len(seqs), global_batch_size) for i in dp_rows(rows, dp_rank, dp)]
    computed: dict[int, torch.Tensor] = {}
    if mine:
        batches, groups = micro_batches(
            [seqs[i] for i in mine], max_tokens=max_tokens, micro_batch_size=micro_batch_size
        )
        for values_BS, group in zip(forward_per_token(model, batches, per_token), groups):
            for i, v in zip(group, response_values(values_BS, [seqs[mine[j]] for j in group])):
                computed[mine[i]] = v
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
    *,
    global_batch_size: int,
    epochs: int,
    max_tokens: int,
    micro_batch_size: int,
    norm_len: int,
    scheduler=None,
    trained: list[bool] | None = None,
) -> dict[str, float]:
    """Collective: ``epochs`` passes of one optimizer step per mini-batch (``scheduler`` stepped before each).
    ``trained`` (default: all) marks the sequences in the loss: the others leave ``loss_mask`` and the global token
    and sequence counts (rejection sampling), though they stay in the micro-batches. Returns the metrics averaged
    over the optimizer steps (``max/`` keys: the maximum), with ``grad_norm`` and ``lr``. A non-finite step raises
    ``NonFiniteUpdate`` (the scheduler is stepped back; the steps before it stay applied) and ends this update.

    A mini-batch with no trained sequence takes no optimizer and no scheduler step (a zero gradient would still move
    Adam's moments and apply weight decay); ``empty_minibatches`` counts them. ``trained`` is the same on every
    rank, so every DP and PP rank skips the same mini-batches without a collective."""
    dp_rank, dp = _dp_coords()
    trained = trained if trained is not None else [True] * len(seqs)
    history: list[dict] = []
    empty = 0
    for _ in range(epochs):
        for rows in minibatch_rows(len(seqs), global_batch_size):
            if not any(trained[i] for i in rows):
                empty += 1
                continue
            batches = _trained_micro_batches(seqs, fields, dp_rows(rows, dp_rank, dp), trained, max_tokens,
                                             micro_batch_size)  # fmt: skip
            norm = GlobalNorm(
                tokens=sum(seqs[i].response_len for i in rows if trained[i]),
                seqs=sum(trained[i] for i in rows),
                norm_len=norm_len,
                scale=float(len(batches) * dp),
            )
            if scheduler is not None:
                scheduler.step(1)
            try:
                history.append(train_step(model, optimizer, batches, make_loss(norm), reduce=SUM))
            except NonFiniteUpdate:
                if scheduler is not None:
                    scheduler.step(-1)
                raise
    keys = history[0].keys() if history else ()
    averaged = {
        k: max(h[k] for h in history) if k.startswith("max/") else sum(h[k] for h in history) / len(history)
        for k in keys
    }
    return {**averaged, "empty_minibatches": float(empty)}


def _trained_micro_batches(seqs: list[Sequence], fields: dict, mine: list[int], trained: list[bool], max_tokens: int,
                           micro_batch_size: int) -> list[dict]:  # fmt: skip
    """This rank's rows ``mine`` of a mini-batch as micro-batches, the sequences not ``trained`` out of the loss
    mask."""
    batches, groups = micro_batches(
        [seqs[i] for i in mine],
        {name: [values[i] for i in mine] for name, values in fields.items()},
        max_tokens=max_tokens,
        micro_batch_size=micro_batch_size,
    )
    for batch, group in zip(batches, groups):
        batch["loss_mask"] *= torch.tensor([float(trained[mine[j]]) for j in group]).unsqueeze(1)
    return batches
