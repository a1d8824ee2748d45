"""The feeds (``megarl.rl.feeds``) without processes: a batch held ahead (one-step-off's, or the one a one-step-off
checkpoint held when a run resumed from it) is trained on first in every mode, then batches are generated."""

from types import SimpleNamespace

import pytest

from megarl.rl.collect import Collected
from megarl.rl.feeds import OneStepOff, Synchronous
from megarl.rl.timer import PhaseTimer


def _feed(cls, ahead):
    place = SimpleNamespace(compute_on=lambda role, fn: fn())  # colocated: the rollout's work runs here
    feed = cls(SimpleNamespace(place=place), ahead)
    feed.generate = lambda step, pool_time: Collected(rounds=step)  # what generating step ``step``'s batch returns
    return feed


@pytest.mark.parametrize("cls", [Synchronous, OneStepOff])
def test_a_batch_held_ahead_is_handed_over_first_then_batches_are_generated(cls):
    held = Collected(rounds=-1)
    feed = _feed(cls, held)
    assert feed.batch(5, PhaseTimer()) is held
    assert feed.ahead is None
    assert feed.batch(6, PhaseTimer()).rounds == 6
