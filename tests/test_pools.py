"""Resource pools: pool-local default process groups in one launch of 4 ranks, Megatron TP=2 on the train pool and a
vLLM engine at TP=2 (external launcher, random weights at start) on the rollout pool; the actor's weights cross the
pools through the resharding planner (verified, at its lower bounds), after which both pools compute the same
log-probabilities."""

import pytest
import torch

from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.pools import Pool, parse_ranks, pool_of
from megarl.parallel.spawn import run_on_ranks
from tests.pools_worker import run_pools

PROMPT = [int(x) for x in torch.randint(3, 259, (40,), generator=torch.Generator().manual_seed(2))]


def test_rank_ranges_parse_and_pools_find_their_ranks():
    assert parse_ranks("0-1") == range(0, 2) and parse_ranks(3) == range(3, 4) and parse_ranks(" 4 - 7") == range(4, 8)
    for bad in ("1-0", "a", "-1", "2-"):
        with pytest.raises(ValueError, match="ranks:"):
            parse_ranks(bad)
    pools = [Pool("train", range(0, 2), ("actor",)), Pool("rollout", range(2, 4), ("rollout",))]
    assert pool_of(pools, 3).name == "rollout" and pools[1].local(3) == 1


@pytest.fixture(scope="module")
def pooled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pools")
    hf = make_tiny_hf_model(str(tmp / "llama"), "llama", seed=3, init_std=0.08)
    out = tmp / "out"
    out.mkdir()
    run_on_ranks(run_pools, 4, hf, str(out), PROMPT, 12)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def test_a_vllm_engine_runs_on_a_pool_local_group_beside_megatron(pooled):
    train, rollout = pooled[:2], pooled[2:]
    for local, r in enumerate(train):
        assert (r["pool"], r["pool_rank"], r["pool_world"], r["tp_group"]) == ("train", local, 2, [0, 1])
        assert not r["vllm_imported"]  # no engine on the train pool
    for local, r in enumerate(rollout):
        assert (r["pool"], r["pool_rank"], r["pool_world"], r["vllm_world"]) == ("rollout", local, 2, [0, 1])
        assert not r["megatron_built"]  # no Megatron model on the rollout pool
    assert rollout[0]["tokens"] == rollout[1]["tokens"] and rollout[0]["logprobs"] == rollout[1]["logprobs"]
    assert len(rollout[0]["tokens"]) == 12
    # after the cross-pool sync the engine (rollout pool) and the actor (train pool) hold the same weights
    for r in train:
        diff = (torch.tensor(r["actor_logprobs"]) - torch.tensor(rollout[0]["logprobs"])).abs().max().item()
        assert diff < 1e-5, diff


def test_the_cross_pool_sync_is_verified_and_moves_the_lower_bound(pooled):
    """Two emulated nodes (train pool: node 0, rollout pool: node 1): each byte crosses once (``node_min``), and what
    both engine ranks need (a norm) is forwarded inside node 1, so each rank receives exactly what it lacks."""
    bounds = pooled[0]["lower_bounds"]
    reports = [r["report"] for r in pooled]
    assert sum(r.bytes_received for r in reports) == sum(r.bytes_sent for r in reports) == bounds["rank_min"]
    assert sum(r.bytes_cross_node for r in reports) == sum(r.bytes_sent for r in reports[:2]) == bounds["node_min"]
    assert all(r.bytes_received == 0 for r in reports[:2])  # the train ranks only send
    for r in pooled:  # a corrupted byte in transit is caught on every rank of both pools, naming the tensor
        assert "hash mismatch" in r["corrupt"] and "gate_up_proj.weight" in r["corrupt"]
