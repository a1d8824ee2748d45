"""LoRA weight sync into a real vLLM engine with LoRA slots (CPU build), colocated with a Megatron actor whose
adapters start random (B != 0: a visible effect) and then take real updates.

Two 2-rank spawns, one engine each: vLLM TP=1 (two engines) fed by Megatron TP=2, rank 4 on every linear (vLLM's
max_lora_rank 8: padded), the base through the shard write; vLLM TP=2 fed by Megatron PP=2, rank 16 on
q/v/down_proj (the fused qkv with k absent), the base through vLLM's full reload (which resets vLLM's LoRA state).
After every sync the engine's log-probabilities of a fixed sequence and of its own generated tokens equal the adapted
Megatron actor's (fp32, 1e-4) and differ from the base's by far more. Then one `megarl train` run of
configs/tiny_grpo_lora.yaml (adapter slots, TP=2) for 3 steps.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megarl.config.schema import LoraConfig
from megarl.models import read_hf_config, spec_from_hf_config
from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.spawn import run_on_ranks
from megarl.planner.memory import lora_sync_bytes
from megarl.reshard.layout import hf_layout, vllm_layout
from tests.lora_sync_worker import run_lora_sync

MATCH = 1e-4
VISIBLE = 0.1  # the adapters change the base's log-probabilities by at least this much
SEQ = [int(x) for x in torch.randint(3, 259, (180,), generator=torch.Generator().manual_seed(0))]
PROMPT = [int(x) for x in torch.randint(3, 259, (200,), generator=torch.Generator().manual_seed(1))]
GROUPS = {  # name: (Megatron (tp, pp, dp), vLLM TP, adapters, vLLM max_lora_rank, the base's transport)
    "vllm_tp1": ((2, 1, 1), 1, LoraConfig(rank=4, alpha=16), 8, "shard_write"),
    "vllm_tp2": ((1, 2, 1), 2, LoraConfig(rank=16, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]), 16,
                 "full_reload"),
}  # fmt: skip
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("lora-sync") / "llama"), "llama", seed=3, init_std=0.08)


@pytest.fixture(scope="module", params=list(GROUPS))
def group(request, hf_dir):
    megatron, vllm_tp, lora, _, transport = GROUPS[request.param]
    return request.param, run_on_ranks(run_lora_sync, 2, hf_dir, megatron, vllm_tp, lora, transport, SEQ, PROMPT)


def _diff(a, b) -> float:
    return float((torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs().max())


def _check_matches_the_actor(step: dict) -> None:
    for score in step["score"]:
        assert _diff(score, step["actor"]) < MATCH
    assert all(g == step["generated"][0] for g in step["generated"])  # every rank (each engine) agrees
    assert _diff(step["generated"][0][1], step["actor_generated"]) < MATCH


def test_every_generation_uses_the_current_adapter(group):
    name, out = group
    assert out["max_lora_rank"] == GROUPS[name][3]  # the smallest value vLLM accepts >= actor.lora.rank
    steps = out["steps"]
    assert _diff(steps[0]["actor"], out["base"]) > VISIBLE  # the adapters matter
    assert _diff(steps[0]["actor"], steps[-1]["actor"]) > VISIBLE / 10  # and the updates changed them
    for step in [*steps, out["recovered"]]:
        _check_matches_the_actor(step)
    ids = [s["adapter"][0] for s in [*steps, out["recovered"]]]
    assert all(s["adapter"] == [s["adapter"][0]] * 2 for s in steps)  # one id on every rank
    assert ids == sorted(set(ids))  # a new adapter id per weight version
    assert all(dirs == [f"adapter-{ids[-2]}"] for dirs in out["adapter_dirs"])  # the previous ones removed
    assert out["adapter_dir_is_the_runs"]  # under the run's /dev/shm prefix: removed with it, also after a kill


def test_syncs_after_the_first_move_only_the_adapters(group, hf_dir):
    name, out = group
    _, vllm_tp, lora, _, transport = GROUPS[name]
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    adapter = lora_sync_bytes(spec, lora, "float32")
    side = vllm_layout(spec, vllm_tp, 2, 2) if transport == "shard_write" else hf_layout(spec, [0, 1], 2)
    shards = [s for rank_shards in side.ranks.values() for s in rank_shards]
    base = 4 * sum(b.numel for s in shards for b in s.blocks if b.hf is not None)  # fp32, padding excluded
    first, *later = out["steps"]
    assert first["report"][0].transport == f"{transport}+lora_slots"  # the base once, then the adapters
    assert sum(r.bytes_received + r.bytes_local for r in first["report"]) == base + 2 * adapter
    for step in later:
        assert step["report"][0].transport == "lora_slots"
        assert sum(r.bytes_received + r.bytes_local for r in step["report"]) == 2 * adapter  # full factors per rank


def test_a_corrupted_adapter_byte_or_a_failed_load_stops_every_rank(group):
    _, out = group
    assert "hash mismatch" in out["corrupt"] and ".lora_B.weight" in out["corrupt"]
    assert out["refused_after_corrupt"]  # unhealthy until the next good sync (checked above: out["recovered"])
    (mine, healthy0, dirs0), (theirs, healthy1, dirs1) = out["one_rank_failed"]
    assert "another rank could not load its copy of the adapter" in mine and "No space left" in theirs
    assert not healthy0 and not healthy1 and dirs0 == dirs1 == []  # the old adapter removed, the new one not left


def test_merge_mode_syncs_whole_merged_weights(group):
    name, out = group
    merged = out["merged"]
    assert merged["report"][0].transport == GROUPS[name][4] and merged["adapter"] == [None, None]
    _check_matches_the_actor(merged)


def _train_lora(out, *overrides, timeout=600) -> list[dict]:
    """`megarl train configs/tiny_grpo_lora.yaml` with LoRA slots (on CPU the default merges: docs/lora.md)."""
    cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/tiny_grpo_lora.yaml", f"trainer.output_dir={out}",
           "rollout.lora_merge=false", "logging.wandb.mode=disabled", "logging.progress_bar=false", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_tiny_grpo_lora_recipe_runs_with_adapter_syncs(tmp_path, hf_dir):
    rows = _train_lora(tmp_path, f"model.path={hf_dir}", "trainer.total_steps=3", "trainer.val_every=0",
                       "data.train_batch_size=4", "actor.global_batch_size=32", "rollout.sampling.max_new_tokens=6")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rollout/weight_version_min"] == r["rollout/weight_version_max"] == r["step"] - 1
        assert r["rollout/logprob_mismatch_max"] < MATCH
    from megarl.config import load_config

    lora = load_config("configs/tiny_grpo_lora.yaml", []).actor.lora
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    assert 0 < rows[-1]["sync/bytes_sent"] <= lora_sync_bytes(spec, lora, "float32")  # the adapters only


@pytest.mark.slow
def test_lora_quickstart_learns_with_adapter_syncs(tmp_path):
    """`make demo-lora`'s run (200 steps, ~50 s here) with LoRA slots: last-10 mean reward >= first-10 + 0.3."""
    model = tmp_path / "tiny-llama-lora"
    subprocess.run([sys.executable, "-m", "megarl.cli", "tiny-model", "--out", str(model), "--init-std", "0.08"],
                   check=True, cwd=REPO)  # fmt: skip
    rows = _train_lora(tmp_path / "run", f"model.path={model}", "trainer.val_every=0", timeout=1200)
    reward = [r["reward/mean"] for r in rows]
    assert len(reward) == 200 and sum(reward[-10:]) / 10 >= sum(reward[:10]) / 10 + 0.3
    assert max(r["rollout/logprob_mismatch_max"] for r in rows) < MATCH
