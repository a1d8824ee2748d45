"""The HF generate engine (the fallback the GPU smoke check uses): a step's prompts in one batch, each sample a
function of its own seed whatever the batch holds, the model kept (its memory freed) across sleeps; and the sampling
itself against the softmax it must draw from."""

from __future__ import annotations

import pytest
import torch

from megarl.algos.sampling import truncate
from megarl.models import read_hf_config
from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.spawn import run_on_ranks
from megarl.rollout.hf_engine import gumbel_noise
from tests.hf_engine_worker import run_hf_engine


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    from megarl.rollout import write_engine_dir

    root = tmp_path_factory.mktemp("hf-engine")
    hf_dir = make_tiny_hf_model(str(root / "llama"), "llama", seed=3, init_std=0.08)
    engine_dir = write_engine_dir(read_hf_config(hf_dir), hf_dir, str(root / "engine"))
    moe_dir = make_tiny_hf_model(str(root / "moe"), "qwen3_moe", seed=4, init_std=0.08)
    moe_engine = write_engine_dir(read_hf_config(moe_dir), moe_dir, str(root / "moe-engine"))
    return run_on_ranks(run_hf_engine, 2, hf_dir, engine_dir, (moe_dir, moe_engine))


def test_one_batch_per_step_and_samples_independent_of_the_batch(dp2):
    assert dp2["calls"] == [dp2["rows"]]  # 4 prompts x n=3 rows, one generate call
    assert dp2["same_tokens_alone"] and dp2["same_tokens_pairs"]  # left padding and batch-mates change nothing
    assert dp2["logprob_diff_alone"] <= 1e-5
    assert dp2["distinct_samples"] > 6  # the n samples of a prompt are not copies of each other


def test_the_trainer_recomputes_the_engines_truncated_logprobs(dp2):
    """top_k=50, top_p=0.95 at T=0.9: the engine returns log-probs of the truncated softmax it drew from (vLLM's
    processed_logprobs) and the trainer recomputes the same; over the whole vocabulary they would differ."""
    diff = dp2["trainer_vs_engine_logprob"]
    print("max |trainer - engine| log-prob:", diff)
    assert diff["truncated"] <= 1e-4, diff
    assert diff["full"] > 1e-2, diff  # the truncation is not a no-op on this model


def test_temperature_zero_is_greedy(dp2):
    """val_sampling.temperature=0: every token is the model's argmax given the tokens before it, whatever the seed
    and the batch (left padding) around it."""
    assert dp2["greedy_is_argmax"] and dp2["greedy_seed_and_batch_free"]


def test_sleep_frees_the_weights_and_the_next_sync_restores_them(dp2):
    assert dp2["asleep_bytes"] == 0 and dp2["awake_bytes"] > 0
    assert dp2["model_kept"] and dp2["same_after_sleep"]  # built once; every parameter rewritten by the sync


def test_qwen3_moe_engine_holds_the_synced_experts(dp2):
    """rollout.backend=hf with Qwen3-MoE: the sync's per-expert tensors land in transformers' fused experts
    (gate_up_proj [E, 2I, H], down_proj [E, H, I]); the engine's logits are transformers' own (fp32)."""
    assert dp2["moe_logits"] <= 1e-5, dp2["moe_logits"]


def test_gumbel_max_draws_from_the_truncated_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    keys = torch.arange(40_000, dtype=torch.int64) * 7919
    z = logits.expand(len(keys), -1)
    for step in (0, 5):
        picks = (z + gumbel_noise(keys, step, 6)).argmax(-1)
        freq = torch.bincount(picks, minlength=6).float() / len(keys)
        assert (freq - logits.softmax(-1)).abs().max() < 0.01, (step, freq)
    kept = truncate(z[:1], top_k=3, top_p=1.0)
    assert torch.isinf(kept[0, 3:]).all() and torch.equal(kept[0, :3], logits[:3])
    nucleus = truncate(z[:1], top_k=0, top_p=0.7)  # softmax: 0.561, 0.206, ...: the first two cover 0.7
    assert torch.isfinite(nucleus[0]).tolist() == [True, True, False, False, False, False]
    assert not torch.equal(gumbel_noise(keys[:4], 0, 6), gumbel_noise(keys[:4], 1, 6))  # fresh noise every step
