"""The resharding engine into a real vLLM engine (CPU build), colocated with a real Megatron actor.

Four 2-rank spawns, one engine each:
- vLLM TP=2 (one engine over both ranks) fed by Megatron PP=2 (Llama);
- vLLM TP=1 (two engines) fed by Megatron TP=2 (Qwen2: tied embeddings, q/k/v bias);
- vLLM TP=2 with the CPU build's weight packing off, to read the engine's parameters back (Qwen2);
- vLLM TP=2 fed by Megatron PP=2, packing off, for Qwen3 (per-head q/k norms, head_dim 64 with 4 heads of
  hidden 128): log-probs, and the parameters read back.
After every sync, through each transport, the engine's log-probabilities for a fixed 180-token sequence and for its
own generated tokens (after a 200-token prompt, so a stale prefix cache would show) equal those of an HF model holding
the same weights, fp32, to 1e-5.
"""

import pytest
import torch

from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.spawn import run_on_ranks
from tests.vllm_sync_worker import run_vllm_sync

TOL = 1e-5
SEQ = [int(x) for x in torch.randint(3, 259, (180,), generator=torch.Generator().manual_seed(0))]
PROMPT = [int(x) for x in torch.randint(3, 259, (200,), generator=torch.Generator().manual_seed(1))]


def _versions(root, family, **kw):
    return {
        v: make_tiny_hf_model(str(root / f"{family}-v{v}"), family, seed=10 * v, init_std=0.08, **kw) for v in (1, 2)
    }


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _versions(tmp_path_factory.mktemp("vllm-llama"), "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _versions(tmp_path_factory.mktemp("vllm-qwen2"), "qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _versions(tmp_path_factory.mktemp("vllm-qwen3"), "qwen3")


@pytest.fixture(scope="module")
def readable_qwen3(qwen3):
    return run_on_ranks(run_vllm_sync, 2, qwen3, (1, 2, 1), 2, SEQ, PROMPT, True)


@pytest.fixture(scope="module")
def tp2(llama):
    return run_on_ranks(run_vllm_sync, 2, llama, (1, 2, 1), 2, SEQ, PROMPT)


@pytest.fixture(scope="module")
def tp1(qwen2):
    return run_on_ranks(run_vllm_sync, 2, qwen2, (2, 1, 1), 1, SEQ, PROMPT)


@pytest.fixture(scope="module")
def readable(qwen2):
    return run_on_ranks(run_vllm_sync, 2, qwen2, (2, 1, 1), 2, SEQ, PROMPT, True)


def _hf_logprobs(hf_dir: str, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= start, from transformers in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return torch.tensor([float(lp[i - 1, ids[i]]) for i in range(start, len(ids))], dtype=torch.float64)


def _check_engine(results, versions):
    assert all(results["rng_restored"]) and all(results["threads_restored"])
    assert results["refused_before_sync"]
    scores = {}
    for step in results["steps"]:
        want = _hf_logprobs(versions[step["version"]], SEQ, 1)
        for rank_score in step["score"]:
            diff = (torch.tensor(rank_score, dtype=torch.float64) - want).abs().max().item()
            assert diff <= TOL, (step["version"], step["transport"], diff)
        scores.setdefault(step["version"], []).append(step["score"][0])
        tokens, logprobs = step["generated"][0]
        assert all(g == step["generated"][0] for g in step["generated"])  # every rank (each engine) agrees
        want_gen = _hf_logprobs(versions[step["version"]], PROMPT + tokens, len(PROMPT))
        diff = (torch.tensor(logprobs, dtype=torch.float64) - want_gen).abs().max().item()
        assert diff <= TOL, ("generated", step["version"], step["transport"], diff)
        for report in step["report"]:
            assert report.layers == 2 + 2 and report.peak_buffer_bytes <= 2 * 1024**2
    # the weights really changed between versions
    assert (torch.tensor(scores[1][0]) - torch.tensor(scores[2][0])).abs().max() > 0.1
    assert "hash mismatch" in results["corrupt"] and "gate_up_proj.weight" in results["corrupt"]
    assert not results["healthy_after_corrupt"] and results["refused_after_corrupt"]
    recovered = torch.tensor(results["score_after_recovery"], dtype=torch.float64)
    assert (recovered - _hf_logprobs(versions[2], SEQ, 1)).abs().max() <= TOL


def test_vllm_tp2_from_megatron_pp2_through_both_transports(tp2, llama):
    _check_engine(tp2, llama)


def test_vllm_tp1_from_megatron_tp2_tied_qwen2(tp1, qwen2):
    _check_engine(tp1, qwen2)


def test_shard_write_moves_fewer_bytes_than_full_reload(tp2):
    by = {s["transport"]: s["report"] for s in tp2["steps"]}
    received = {t: sum(r.bytes_received + r.bytes_local for r in reports) for t, reports in by.items()}
    assert received["shard_write"] < received["full_reload"]


def test_vllm_layout_description_matches_the_engine(readable):
    for rank, layout in enumerate(readable["layout"]):
        assert layout["engine"] == layout["described"], rank
        assert layout["unequal"] == [], rank  # the shard-written parameters are bitwise the expected shards


def test_vllm_tp2_qwen3_log_probs_and_layout_match_the_engine(readable_qwen3, qwen3):
    _check_engine(readable_qwen3, qwen3)
    for rank, layout in enumerate(readable_qwen3["layout"]):
        assert layout["engine"] == layout["described"], rank
        assert layout["unequal"] == [], rank
