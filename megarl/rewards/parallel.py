"""Rewards scored in parallel across ranks: each rank scores a share, then every rank gets all scores.

- ``score_on_ranks``: a whole batch after generation, each rank a contiguous share (validation).
- ``GroupScores``: the training batch's prompt groups as the engines finish them, each on one rank of the engine
  that generated it; a slow reward (a judge, a sandbox) then runs in the reward workers while the engine generates.

Deterministic either way: a sample's score depends only on the sample (never on which rank or call scored it)."""

from __future__ import annotations

import torch.distributed as dist

from megarl.parallel.layout import prompt_slice
from megarl.rewards.results import ScoreResult, merge


def score_on_ranks(rewards, prompts: list[str], responses: list[str], ground_truths: list, extras: list[dict]):
    """Collective over the world: the ``ScoreResult`` of the whole batch on every rank, each rank scoring its share
    with ``rewards`` (an ``InProcess`` or a ``RewardPool``: ``megarl.rewards.scorer``)."""
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
    return merge(parts)


class GroupScores:
    """One generation round's scores, submitted group by group while the engines generate (``add`` is the engine's
    ``on_group``); ``result()`` is collective over the world."""

    def __init__(self, rewards, prompts: dict, tokenizer, engine_tp: int):
        """``prompts``: global prompt index -> ``Prompt``; ``engine_tp``: ranks per engine (a group is scored on
        the engine rank ``prompt index % engine_tp``)."""
        self.rewards, self.prompts, self.tokenizer, self.tp = rewards, prompts, tokenizer, engine_tp
        self.mine: list[int] = []
        """The prompt indices of the groups this rank submitted and not yet collected, in order."""

    def owns(self, index: int) -> bool:
        """Whether prompt ``index``'s group is this rank's to score (one rank of the engine that generated it)."""
        return index % self.tp == dist.get_rank() % self.tp

    def add(self, group: list) -> None:
        """A finished prompt group (its samples): to this rank's reward workers if it is this rank's to score."""
        index = group[0].prompt_index
        if not self.owns(index):
            return
        p = self.prompts[index]
        responses = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in group]
        self.mine.append(index)
        self.rewards.submit([p.prompt_text] * len(group), responses, [p.ground_truth] * len(group),
                            [p.extras] * len(group))  # fmt: skip

    def collect(self) -> dict[int, ScoreResult]:
        """This rank's groups added since the last ``collect``, scored (waits for them): prompt index -> result."""
        results = self.rewards.finish()
        if len(results) != len(self.mine):
            raise RuntimeError(f"the reward workers answered {len(results)} of {len(self.mine)} prompt groups")
        scored, self.mine = dict(zip(self.mine, results)), []
        return scored

    def result(self) -> ScoreResult:
        """Collective: every sample's score, in (prompt, sample) order, on every rank."""
        parts = list(self.collect().items())
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, parts)
        ordered = sorted((p for rank_parts in everyone for p in rank_parts), key=lambda p: p[0])
        return merge([part for _, part in ordered])
