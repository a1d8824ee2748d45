"""Micro-batch layout: ``collate``'s ``scored_from`` (the first position the loss scores) and ``positions_from`` (the
loss's fields from the position the output layer started at)."""

import torch

from megarl.backend.batch import Sequence, collate
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
