"""Rewards scored in parallel across ranks: each rank scores a contiguous share, then every rank gets all scores."""

from __future__ import annotations

import torch.distributed as dist

from megarl.rewards.score import ScoreResult, score_batch
from megarl.rollout.protocol import prompt_slice


def score_on_ranks(fn, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]):
    """Collective over the world: the same ``ScoreResult`` as ``score_batch`` on the whole batch, on every rank.

    Deterministic: a sample's score depends only on the sample (never on which rank scored it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = prompt_slice(len(prompts), rank, world)
    part = score_batch(
        fn,
        [prompts[i] for i in mine],
        [responses[i] for i in mine],
        [ground_truths[i] for i in mine],
        [extras[i] for i in mine],
    )
    parts: list[ScoreResult] = [None] * world
    dist.all_gather_object(parts, part)
    parts = [p for p in parts if p.scores]  # ranks with an empty share carry no extra fields
    keys = set.intersection(*(set(p.extra) for p in parts)) if parts else set()
    return ScoreResult(
        scores=[s for p in parts for s in p.scores],
        extra={k: [v for p in parts for v in p.extra[k]] for k in sorted(keys)},
        errors=sum(p.errors for p in parts),
        first_error=next((p.first_error for p in parts if p.first_error), None),
    )
