"""The staleness arithmetic of bounded asynchronous RL (``megarl.rollout.stream``), checked by simulating the
schedule: the trainer takes batch t (serials (t-1)B .. tB-1) at version t-1 and pushes weights every ``sync_every``
updates; the rollout admits a serial as soon as the rule lets it."""

from __future__ import annotations

import pytest

from megarl.rollout.stream import admission_limit, batch_of, oldest_version, stream_seed


def _schedule(max_staleness: int, sync_every: int, batch: int, steps: int):
    """The version each serial is admitted at (as early as the rule allows), or None if admission stalls."""
    admitted, issued = {}, 0
    for step in range(1, steps + 1):
        engine = (step - 1) // sync_every * sync_every  # the last version pushed before the trainer takes `step`
        while issued < admission_limit(max_staleness, engine, batch):
            admitted.setdefault(issued, engine)
            issued += 1
        if issued < step * batch:  # batch `step` cannot be completed: the trainer would wait forever
            return None
    return admitted


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("sync_every", [1, 2, 3, 4])
def test_admission_keeps_every_token_within_the_bound_and_stalls_only_when_sync_every_exceeds_it(
    max_staleness, sync_every
):
    batch, steps = 3, 12
    admitted = _schedule(max_staleness, sync_every, batch, steps)
    if sync_every > max_staleness + 1:  # what validation refuses
        assert admitted is None
        return
    assert admitted is not None
    for serial, version in admitted.items():
        step = batch_of(serial, batch)
        if step <= steps:
            # a serial's first token comes from the version it was admitted at; later tokens only from newer ones
            assert version >= oldest_version(step, max_staleness)
    # the bound is tight: with pushes every update, some serial is admitted exactly max_staleness versions early
    if sync_every == 1 and max_staleness > 0:
        assert any(v == oldest_version(batch_of(i, batch), max_staleness) for i, v in admitted.items() if v > 0)


def test_one_step_off_is_the_bound_of_one():
    """max_staleness=1, a push per update: batch k is admitted at version k-2 (the first two at 0), as one-step-off."""
    admitted = _schedule(1, 1, 2, 6)
    assert [admitted[2 * (k - 1)] for k in range(1, 7)] == [0, 0, 1, 2, 3, 4]


def test_stream_seeds_are_distinct_across_prompts_samples_and_segments():
    n = 4
    seeds = {stream_seed(7, serial, n, segment) + i for serial in range(50) for segment in range(3) for i in range(n)}
    assert len(seeds) == 50 * 3 * n
    assert stream_seed(7, 3, n) == stream_seed(7, 3, n, 0)
