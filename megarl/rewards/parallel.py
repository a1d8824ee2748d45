"""Rewards scored in parallel across ranks: each rank scores a contiguous share, then every rank gets all scores."""

from __future__ import annotations

import torch.distributed as dist

from megarl.rewards.score import ScoreResult
from megarl.rollout.protocol import prompt_slice


def score_on_ranks(rewards, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]):
    """Collective over the world: the ``ScoreResult`` of the whole batch on every rank, each rank scoring its share
    with ``rewards`` (an ``InProcess`` or a ``RewardPool``: ``megarl.rewards.scorer``).

    Deterministic: a sample's score depends only on the sample (never on which rank scored it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = prompt_slice(len(prompts), rank, world)
    part = rewards.score(
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
        failed=[f for p in parts for f in p.failed],
        extra={k: [v for p in parts for v in p.extra[k]] for k in sorted(keys)},
        first_error=next((p.first_error for p in parts if p.first_error), None),
    )
