"""Micro-batch layout: ``collate``'s ``scored_from`` (the first position the loss scores) and ``positions_from`` (the
loss's fields from the position the output layer started at); packing: the budget, token-balanced DP shares, padding
on long-tailed lengths, lockstep fillers."""

import math
import random

import pytest
import torch

from megarl.backend.batch import (
    FILLER,
    MICRO_BATCH_COST,
    Batching,
    PackStats,
    Sequence,
    collate,
    micro_batches,
    pack_micro_batches,
    plan,
    share_out,
)
from megarl.backend.step import positions_from


def test_scored_from_is_the_shortest_prompts_first_scored_position():
    mb = collate([Sequence([5, 6, 7, 8, 9], prompt_len=3), Sequence([5, 6, 7, 8, 9, 10], prompt_len=2)])
    assert mb["scored_from"] == 1  # the second sequence's first response token is scored at position 1
    assert mb["loss_mask"][1, :1].sum() == 0 and mb["loss_mask"][1, 1] == 1 and mb["loss_mask"][0, 1] == 0


def test_scored_from_keeps_one_position_when_no_sequence_has_a_response():
    mb = collate([Sequence([5, 6, 7], prompt_len=3)])
    assert mb["tokens"].shape == (1, 2) and mb["scored_from"] == 1 and mb["loss_mask"].sum() == 0


def test_positions_from_slices_every_per_position_field_and_keeps_the_rest():
    mb = collate([Sequence([5, 6, 7, 8, 9], prompt_len=3)], {"advantages": [torch.tensor([0.5, -0.5])]})
    mb["per_sequence"] = torch.ones(1)
    sliced = positions_from(mb, 2)
    assert sliced["scored_from"] == 2 and sliced["per_sequence"] is mb["per_sequence"]
    assert torch.equal(sliced["targets"], mb["targets"][:, 2:])
    assert torch.equal(sliced["advantages"], torch.tensor([[0.5, -0.5]]))
    assert positions_from(mb, 0)["targets"].shape == mb["targets"].shape  # the layer could not skip: all positions
    plain = {"tokens": mb["tokens"]}
    assert positions_from(plain, 0) is plain  # no scored_from: the micro-batch as it is


# ---- packing: a pure function of the lengths (megarl.backend.batch.plan) ----

def _reasoning_lengths(rng: random.Random, n: int, median: float, sigma: float, cap: int, prompt: int = 150):
    """Prompt + lognormal response, in positions (tokens - 1), as the issue measured them."""
    return [prompt + min(cap, max(1, int(median * math.exp(rng.gauss(0, sigma))))) - 1 for _ in range(n)]


def _padding(lengths, ranks, batching) -> PackStats:
    stats = PackStats()
    for groups in plan(lengths, ranks, batching):
        stats.count(groups, lengths)
    return stats


def _cost(lengths, groups, budget) -> float:
    """Padded positions plus the fixed cost per micro-batch that ``pack_micro_batches`` weighs."""
    return sum(len(g) * max(lengths[i] for i in g) + MICRO_BATCH_COST * budget for g in groups)


def _fewest_sorted(lengths, budget) -> list[list[int]]:
    """Longest first, each micro-batch filled while it fits: the fewest micro-batches of the sorted order."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@pytest.mark.parametrize("packing", ["sorted", "consecutive"])
def test_every_micro_batch_fits_the_budget_and_every_sequence_is_in_one(packing):
    rng = random.Random(1)
    for _ in range(500):
        lengths = [rng.randint(1, 80) for _ in range(rng.randint(0, 40))]
        budget = rng.randint(1, 200)
        groups = pack_micro_batches(lengths, max_tokens=budget, micro_batch_size=1, packing=packing)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= budget for g in groups)
        if packing == "sorted":  # no dearer than the fewest micro-batches of the sorted order
            assert _cost(lengths, groups, budget) <= _cost(lengths, _fewest_sorted(lengths, budget), budget) + 1e-9
    assert pack_micro_batches([3, 9, 5, 9], max_tokens=0, micro_batch_size=3) == [[1, 3, 2], [0]]  # longest first


def test_shares_are_token_balanced_within_the_longest_sequence():
    """Any two DP ranks' tokens differ by at most the longest sequence; every rank gets one when it can; the shares
    are a pure function of the lengths."""
    rng = random.Random(2)
    for _ in range(300):
        ranks = rng.randint(1, 8)
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(ranks, 64))]
        shares = share_out(lengths, ranks)
        assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
        tokens = [sum(lengths[i] for i in s) for s in shares]
        assert max(tokens) - min(tokens) <= max(lengths) and all(shares)
        assert shares == share_out(list(lengths), ranks)
    front = [400] * 8 + [10] * 8  # every long sequence in the first half
    contiguous = [sum(front[i] for i in s) for s in share_out(front, 2, "consecutive")]
    balanced = [sum(front[i] for i in s) for s in share_out(front, 2)]
    assert contiguous == [3200, 80] and balanced == [1640, 1640]


def test_ties_in_tokens_go_to_the_rank_with_less_attention():
    # after 6 -> rank 0 and 3, 3 -> rank 1, both hold 6 tokens; rank 1's squares (18) are fewer than rank 0's (36)
    assert share_out([6, 3, 3, 2], 2) == [[0], [1, 2, 3]]


@pytest.mark.parametrize(
    "median, sigma, cap, most_sorted, least_consecutive",
    [(600, 1.0, 8192, 0.08, 0.45), (300, 0.7, 2048, 0.12, 0.45), (15, 0.1, 64, 0.02, 0.02)],
)
def test_sorted_packing_removes_most_padding_on_long_tailed_lengths(median, sigma, cap, most_sorted,
                                                                    least_consecutive):  # fmt: skip
    """The issue's table: 256 sequences per rank (2 ranks), prompts of 150 tokens, lognormal responses, a budget of
    16,384 tokens: batch order computes about half padding on reasoning lengths, sorted a tenth or less."""
    rng = random.Random(3)
    for _ in range(5):
        lengths = _reasoning_lengths(rng, 512, median, sigma, cap)
        got = {p: _padding(lengths, 2, Batching(512, 16384, 1, p)) for p in ("sorted", "consecutive")}
        assert got["sorted"].real == got["consecutive"].real
        assert got["sorted"].padding_frac <= most_sorted
        assert got["consecutive"].padding_frac >= least_consecutive
        assert got["sorted"].micro_batches <= got["consecutive"].micro_batches


def test_lockstep_tops_ranks_up_with_fillers_that_weigh_nothing():
    lengths = [40, 10, 10, 10, 10]  # one rank takes the 40, the other the four 10s: 1 and 2 micro-batches of 2
    assert [len(g) for g in plan(lengths, 2, Batching(5, 0, 2))] == [1, 2]
    locked = plan(lengths, 2, Batching(5, 0, 2), lockstep=True)
    assert locked == [[[0], []], [[1, 2], [3, 4]]]
    groups = [g for rank in locked for g in rank]
    seqs = [Sequence(list(range(n + 1)), 1) for n in lengths]
    batches = micro_batches(seqs, groups, {"advantages": [torch.ones(n) for n in lengths]})
    filler = batches[1]
    assert filler["tokens"].shape == (1, len(FILLER.tokens) - 1) and filler["loss_mask"].sum() == 0
    assert filler["advantages"].sum() == 0
    stats = PackStats()
    stats.count([[]], lengths)
    assert (stats.computed, stats.real, stats.micro_batches) == (1, 0, 1)
