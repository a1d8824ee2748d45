"""ParallelLayout rank arithmetic, checked against Megatron's own RankGenerator (no processes needed)."""

import pytest
from megatron.core.parallel_state import RankGenerator

from megarl.parallel.layout import ParallelLayout


def _megatron_groups(layout: ParallelLayout, kind: str) -> list[list[int]]:
    gen = RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=1, order="tp-cp-ep-dp-pp")
    return gen.get_ranks(kind)


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (4, 8, 2), (8, 2, 4)])
def test_groups_equal_megatron(tp, pp, dp):
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    assert sorted(layout.tp_groups()) == sorted(_megatron_groups(layout, "tp"))
    assert sorted(layout.pp_groups()) == sorted(_megatron_groups(layout, "pp"))
    assert sorted(layout.dp_groups()) == sorted(_megatron_groups(layout, "dp"))


@pytest.mark.parametrize("tp,pp,dp,ep", [(1, 1, 2, 2), (1, 2, 2, 2), (1, 1, 8, 2), (2, 2, 4, 4), (1, 4, 8, 8)])
def test_expert_groups_equal_megatron(tp, pp, dp, ep):
    """EP inside DP: Megatron's expert rank generator (expert TP = TP, expert DP = dp / ep) gives the same groups."""
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    gen = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    assert sorted(layout.ep_groups()) == sorted(gen.get_ranks("ep"))
    assert sorted(layout.expert_dp_groups()) == sorted(gen.get_ranks("dp"))
    assert sorted(layout.dp_groups()) == sorted(_megatron_groups(layout, "dp"))  # the dense DP groups unchanged
    for rank in range(layout.world_size):
        assert layout.ep_group(rank).index(rank) == layout.ep_rank(rank)


def test_ep_must_divide_dp():
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        ParallelLayout(dp=4, ep=3)
    assert str(ParallelLayout(dp=4, ep=2)) == "TP=1 PP=1 DP=4 EP=2 (world 4)"


def test_coords_round_trip_tp4_pp8_dp2():
    layout = ParallelLayout(tp=4, pp=8, dp=2, gpus_per_node=8)
    assert layout.world_size == 64
    seen = set()
    for rank in range(64):
        c = layout.coords(rank)
        assert layout.rank(c.tp, c.pp, c.dp) == rank
        seen.add((c.tp, c.pp, c.dp))
    assert len(seen) == 64
    assert layout.coords(0) == layout.coords(0).__class__(tp=0, pp=0, dp=0)
    assert layout.coords(5).tp == 1 and layout.coords(5).dp == 1 and layout.coords(5).pp == 0
    assert layout.coords(63).pp == 7


def test_tp4_pp8_dp2_on_8_nodes_of_8():
    layout = ParallelLayout(tp=4, pp=8, dp=2, gpus_per_node=8)
    assert layout.num_nodes == 8
    assert layout.tp_groups_within_nodes()
    for group in layout.tp_groups():
        assert len({layout.node(r) for r in group}) == 1
    assert layout.tp_group(13) == [12, 13, 14, 15]
    assert layout.dp_group(13) == [9, 13]
    assert layout.pp_group(1) == [1 + 8 * s for s in range(8)]
    # each pipeline stage (both DP replicas of it) fills exactly one node
    for stage in range(8):
        ranks = [r for r in range(64) if layout.coords(r).pp == stage]
        assert {layout.node(r) for r in ranks} == {stage}
    assert layout.node_ranks(7) == list(range(56, 64))
    assert layout.model_parallel_group(0) == sorted(r for r in range(64) if layout.coords(r).dp == 0)


def test_tp_group_crossing_nodes_is_detected():
    assert not ParallelLayout(tp=8, pp=1, dp=2, gpus_per_node=4).tp_groups_within_nodes()


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="tp"):
        ParallelLayout(tp=0)
    layout = ParallelLayout(tp=2, dp=2)
    with pytest.raises(ValueError, match="outside world"):
        layout.coords(4)
    with pytest.raises(ValueError, match="outside layout"):
        layout.rank(tp=2)
    with pytest.raises(ValueError, match="gpus_per_node"):
        layout.node(0)
