"""Megatron layouts vs the single-rank reference: equal loss (1e-5 relative) and equal weights after one step (1e-5).

One spawned process group per world size serves every case of that size (spawning costs ~20 s here).
"""

import pytest

from megarl.parallel.layout import ParallelLayout as L
from megarl.parallel.spawn import run_on_ranks
from tests.parity_worker import run_cases, tiny_spec

RTOL_LOSS = 1e-5
ATOL_WEIGHTS = 1e-5

WORLD2 = [
    ("ref", dict(layout=L(dp=2), spec=tiny_spec(), reference=True)),
    ("tp2", dict(layout=L(tp=2), spec=tiny_spec())),
    ("pp2", dict(layout=L(pp=2), spec=tiny_spec())),  # 4 micro-batches through the 1F1B schedule
    ("ref_tied", dict(layout=L(dp=2), spec=tiny_spec(tied=True), reference=True)),
    ("pp2_tied", dict(layout=L(pp=2), spec=tiny_spec(tied=True))),
    ("ref_qwen3", dict(layout=L(dp=2), spec=tiny_spec(qwen3=True), reference=True)),
    ("tp2_qwen3", dict(layout=L(tp=2), spec=tiny_spec(qwen3=True))),  # q/k norms' gradients summed over TP
    ("ref_moe", dict(layout=L(dp=2), spec=tiny_spec(moe=True), reference=True)),
    ("dp2_moe", dict(layout=L(dp=2), spec=tiny_spec(moe=True))),  # the router and experts' gradients over DP
    ("pp2_moe", dict(layout=L(pp=2), spec=tiny_spec(moe=True))),  # a routed layer on each stage
    ("ep2_moe", dict(layout=L(dp=2, ep=2), spec=tiny_spec(moe=True))),  # each rank 2 of the 4 experts
]
WORLD4 = [
    ("ref", dict(layout=L(dp=4), spec=tiny_spec(), reference=True)),
    ("tp2pp2", dict(layout=L(tp=2, pp=2), spec=tiny_spec())),
    ("tp2dp2", dict(layout=L(tp=2, dp=2), spec=tiny_spec())),
    ("ref_adam", dict(layout=L(dp=4), spec=tiny_spec(), reference=True, adam=True)),
    ("tp2dp2_adam", dict(layout=L(tp=2, dp=2), spec=tiny_spec(), adam=True)),
    ("tp2dp2_distopt_adam", dict(layout=L(tp=2, dp=2), spec=tiny_spec(), adam=True, distributed_optimizer=True)),
    ("ref_tied", dict(layout=L(dp=4), spec=tiny_spec(tied=True), reference=True)),
    ("tp2pp2_tied", dict(layout=L(tp=2, pp=2), spec=tiny_spec(tied=True))),
    ("ref_value", dict(layout=L(dp=4), spec=tiny_spec(), reference=True, value_head=True)),
    ("tp2pp2_value", dict(layout=L(tp=2, pp=2), spec=tiny_spec(), value_head=True)),
]


@pytest.fixture(scope="module")
def world2():
    return run_on_ranks(run_cases, 2, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return run_on_ranks(run_cases, 4, WORLD4)


def _assert_matches(case: dict, ref: dict):
    assert abs(case["loss"] - ref["loss"]) <= RTOL_LOSS * abs(ref["loss"]), (case["loss"], ref["loss"])
    assert case["weights"].keys() == ref["weights"].keys()
    for name, w_ref in ref["weights"].items():
        w = case["weights"][name]
        assert w.shape == w_ref.shape, name
        diff = (w - w_ref).abs().max().item()
        assert diff <= ATOL_WEIGHTS, f"{name}: max |w - w_ref| = {diff}"
    # the step must really move the weights, far beyond the tolerance, or the comparison proves nothing
    moved = max((ref["weights"][n] - ref["initial"][n]).abs().max().item() for n in ref["weights"])
    assert moved > 100 * ATOL_WEIGHTS


def _ref_name(case: str) -> str:
    for suffix in ("tied", "adam", "value", "qwen3", "moe"):
        if suffix in case:
            return f"ref_{suffix}"
    return "ref"


@pytest.mark.parametrize("case", [n for n, _ in WORLD2 if not n.startswith("ref")])
def test_world2_matches_single_rank(world2, case):
    _assert_matches(world2[case], world2[_ref_name(case)])


@pytest.mark.parametrize("case", [n for n, _ in WORLD4 if not n.startswith("ref")])
def test_world4_matches_single_rank(world4, case):
    _assert_matches(world4[case], world4[_ref_name(case)])


def test_distributed_optimizer_really_shards(world4):
    assert world4["tp2dp2_distopt_adam"]["optimizer"] == "DistributedOptimizer"
    assert world4["tp2dp2_adam"]["optimizer"] == "FP32Optimizer"


def test_value_head_outputs_one_scalar_per_token(world4):
    head = world4["tp2pp2_value"]["weights"]["output_layer.weight"]
    assert head.shape == (1, tiny_spec().hidden_size)
    assert world4["tp2pp2_value"]["values_shape"] == [1, 16, 1]
