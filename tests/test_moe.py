"""Routed-expert layers' load-balancing loss (``megarl.backend.moe``): its value equals an fp64 oracle written from
the Switch Transformer formula over the non-padding tokens, and at coefficient c it adds c times that loss's
gradient to the router's."""

import pytest
import torch

from megarl.backend.moe import switch_load_balancing_loss
from megarl.parallel.spawn import run_on_ranks
from tests.moe_worker import oracle, run_aux_loss


@pytest.fixture(scope="module")
def aux():
    return run_on_ranks(run_aux_loss, 2)


def test_the_load_balancing_loss_equals_the_fp64_oracle_per_layer_and_micro_batch(aux):
    assert len(aux["kept"]) == 4 == len(aux["oracle"])  # 2 routed layers x 2 micro-batches
    for kept, want in zip(aux["kept"], aux["oracle"]):
        assert abs(kept - want) <= 1e-6 * max(1.0, abs(want)), (kept, want)
    assert abs(aux["logged"] - sum(aux["oracle"]) / 4) <= 1e-6


def test_the_coefficient_adds_its_multiple_of_the_loss_gradient_to_the_router(aux):
    added, want = aux["grad_added"], aux["grad_want"]
    assert want.abs().max() > 1e-4  # the term is visible against the comparison's tolerance
    assert torch.allclose(added, want, atol=1e-6, rtol=0), (added - want).abs().max()
    assert aux["first_router_moved"] > 0  # the first layer's router gets its own term too


def test_padding_is_left_out_and_a_uniform_router_scores_one():
    logits = torch.randn(6, 4)
    valid = torch.tensor([True, True, True, False, True, False])
    got = switch_load_balancing_loss(logits, 2, valid)
    want = oracle(logits.unsqueeze(1), torch.eye(4), 2, valid)
    assert abs(float(got) - float(want)) <= 1e-6
    assert abs(float(switch_load_balancing_loss(torch.zeros(8, 4), 2)) - 1.0) < 1e-6
