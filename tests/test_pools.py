"""Resource pools: pool-local default process groups in one launch of 4 ranks, Megatron TP=2 on the train pool and a
vLLM engine at TP=2 (external launcher, random weights at start) on the rollout pool; the actor's weights cross the
pools through the resharding planner (verified, at its lower bounds), after which both pools compute the same
log-probabilities."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.layout import Pool, parse_ranks, pool_of
from megarl.parallel.spawn import run_on_ranks
from tests.metric_tolerance import TOKEN_FRACTIONS, far_apart
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


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO = ["trainer.total_steps=2", "trainer.save_every=2", "trainer.val_every=0", "logging.wandb.mode=disabled",
       "logging.progress_bar=false", "data.train_batch_size=4", "actor.global_batch_size=8",
       "rollout.sampling.max_new_tokens=6",
       # Megatron's unfused attention: with sdpa the critic/vf_clipfrac of the critic at TP=2 (colocated) and at
       # TP=1 (its pool) differed by 5-8 of 96 tokens while the weights after 2 steps still agreed within 1e-5
       # (issue 42's note). This test is about pools, not attention.
       "model.attention=unfused"]  # fmt: skip
RTOL = 1e-5
"""The parity tests' tolerances (tests/test_rl_update.py; relative to values of at least 1e-2: a loss near zero is a
difference of larger terms): the critic's TP differs, so the order of its sums does."""
ATOL_WEIGHTS = 1e-5
POOLED = ("timing/", "perf/", "memory/", "sync/", "pool/", "rollout/tokens_per_s")


def _train(recipe, hf_dir, out, extra=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "megarl.cli", "train", recipe, f"model.path={hf_dir}", f"trainer.output_dir={out}",
           *PPO, *extra]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _checkpoint(iter_dir, tmp):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(tmp, f"{abs(hash(str(iter_dir)))}.pt")
    dcp_to_torch_save(str(iter_dir), path)
    return {k: v for k, v in torch.load(path, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def ppo_runs(tiny_llama_dir, tmp_path_factory):
    """PPO for 2 steps colocated at TP=2, and with the critic and the reference on their own 1-rank pool at TP=1
    (configs/tiny_ppo_pools.yaml: 5 ranks), stopped after step 1 and resumed (the critic pool's models come back
    from iter_1/critic: a fresh critic or optimizer would show in step 2's values and weights)."""
    tmp = tmp_path_factory.mktemp("ppo-pools")
    colocated = _train("configs/tiny_ppo.yaml", tiny_llama_dir, tmp / "colocated")
    _train("configs/tiny_ppo_pools.yaml", tiny_llama_dir, tmp / "pooled", ["trainer.total_steps=1"])
    assert (tmp / "pooled" / "checkpoints" / "iter_0000001" / "critic").is_dir()
    pooled = _train("configs/tiny_ppo_pools.yaml", tiny_llama_dir, tmp / "pooled")
    return {"tmp": tmp, "colocated": colocated, "pooled": pooled}


def test_a_critic_on_its_own_pool_and_layout_trains_as_colocated(ppo_runs):
    """The same samples (their rewards are equal), losses and values within the parity tolerances."""
    for a, b in zip(ppo_runs["colocated"], ppo_runs["pooled"], strict=True):
        keys = {k for k in a if not k.startswith(POOLED)}
        assert keys == {k for k in b if not k.startswith(POOLED)}
        assert {"critic/vf_loss", "critic/values_mean", "actor/pg_loss", "actor/ppo_kl"} <= keys
        assert a["reward/mean"] == b["reward/mean"] and a["response_length/mean"] == b["response_length/mean"]
        noise = {"rollout/logprob_mismatch_mean", "rollout/logprob_mismatch_max"}  # float noise itself (~1e-6)
        assert all(b[k] < 1e-4 for k in noise)
        # The clip fractions are counts of tokens past a threshold: the critic runs at another TP here, and after an
        # Adam step (~lr x sign(g)) its values differ by more than float noise, so tokens near the value clip cross
        # it either way (seen: 1, 2 and 4 of 96 on fresh machines, 5-8 with sdpa attention). They are not compared;
        # the losses, values and (next test) the weights they came from are.
        fractions = {k for k in keys if k.endswith(TOKEN_FRACTIONS)}
        assert fractions and all(0 <= b[k] <= 1 for k in fractions)
        # floor 3e-2: step 2's actor/pg_loss (-0.00456, a mean of advantage x ratio terms of size ~1) came out
        # 1.2e-7 apart with torch's fused Adam on CPU and 7.5e-8 apart with its default loop (floor 1e-2 allows 1e-7)
        assert not (far := far_apart(a, b, keys - noise - fractions, rtol=RTOL, floor=3e-2, token_share=0)), far
        assert {"pool/train/busy_s", "pool/critic/busy_s", "pool/rollout/busy_s"} <= b.keys()


def test_the_updated_weights_of_both_models_match_colocated(ppo_runs):
    """The checkpoint after 2 steps: the actor (train pool, iter_N) and the critic (critic pool, iter_N/critic) equal
    the colocated run's within the parity tolerance."""
    tmp, it = ppo_runs["tmp"], "checkpoints/iter_0000002"
    ref = _weights(_checkpoint(tmp / "colocated" / it, tmp))
    actor = _weights(_checkpoint(tmp / "pooled" / it, tmp))
    critic = _weights(_checkpoint(tmp / "pooled" / it / "critic", tmp))
    assert actor and not any(k.startswith("critic.") for k in actor)  # no critic on the train pool
    assert critic and all(k.startswith("critic.") for k in critic)  # no actor on the critic pool
    assert actor.keys() | critic.keys() == ref.keys()
    for k, v in {**actor, **critic}.items():
        diff = (v.float() - ref[k].float()).abs().max().item()
        assert diff <= ATOL_WEIGHTS, f"{k}: max |w - w_colocated| = {diff}"


def _weights(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith(("optimizer", "rng"))}


def test_placement_of_the_critic_pool_really_happened(ppo_runs):
    ranks = json.loads((ppo_runs["tmp"] / "pooled" / "placement.json").read_text())
    assert [(r["pool"], r["megatron_models"], r["vllm_engine"]) for r in ranks] == [
        ("train", ["actor"], False), ("train", ["actor"], False), ("critic", ["critic", "reference"], False),
        ("rollout", [], True), ("rollout", [], True)]  # fmt: skip
