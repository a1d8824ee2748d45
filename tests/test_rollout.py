"""Rollout engines under torchrun: vLLM (CPU build, external_launcher) and HF generate, fed by the resharding engine.

Two torchrun launches (one vLLM engine per rank each):
- 2 ranks, Llama: Megatron TP=2, vLLM TP=2 (one engine over both ranks);
- 4 ranks, Qwen2 (tied, q/k/v bias): Megatron TP=2 x DP=2, vLLM TP=2 (two engines).
In each: sync, an actor update (Adam step), sync again, rollouts at T=1 and T=0.7 with every rank's global RNG set
differently, the Megatron actor's recomputed log-probabilities of the generated tokens, then an update left unsynced.
"""

import json
import os
import subprocess
import sys

import pytest

from megarl.models.tiny import make_tiny_hf_model

MATCH = 1e-4  # max |logp_rollout - logp_train| over tokens, fp32, same weights


def _torchrun(nproc: int, args: dict, tmp) -> list[dict]:
    out = tmp / "out"
    out.mkdir()
    args = {**args, "out": str(out)}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "PET_LOG_DIR": str(tmp / "torchelastic")}  # torchrun's log directory (default: a new one in /tmp)
    proc = subprocess.run(
        [torchrun, "--standalone", f"--nproc-per-node={nproc}", "tests/rollout_worker.py", json.dumps(args)],
        env=env, capture_output=True, text=True, timeout=900,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.load(open(out / f"rank{r}.json")) for r in range(nproc)]


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout-llama")
    hf = make_tiny_hf_model(str(tmp / "llama"), "llama", seed=3, init_std=0.08)
    return _torchrun(2, {"hf_dir": hf, "megatron": [2, 1, 1], "rollout_tp": 2}, tmp)


@pytest.fixture(scope="module")
def qwen2_dp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout-qwen2")
    hf = make_tiny_hf_model(str(tmp / "qwen2"), "qwen2", seed=4, init_std=0.08, tie_word_embeddings=True)
    return _torchrun(4, {"hf_dir": hf, "megatron": [2, 1, 2], "rollout_tp": 2}, tmp)


def _steps(ranks, engine):
    return [[s for s in r["version_steps"] if s["engine"] == engine] for r in ranks]


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_rollout_logprobs_match_the_actor_after_update(llama_tp2, qwen2_dp2, engine):
    for ranks in (llama_tp2, qwen2_dp2):
        for per_rank in _steps(ranks, engine):
            assert {s["temperature"] for s in per_rank} == {1.0, 0.7}
            assert sum(s["truncated"] for s in per_rank) == 1  # top_k=20, top_p=0.8: the trainer truncates alike
            for s in per_rank:
                assert s["versions"] == [1]
                assert s["logprob_mismatch_max"] <= MATCH, (engine, s["temperature"], s["logprob_mismatch_max"])
                if s["truncated"]:
                    print(f"{engine} top_k=20 top_p=0.8: max |engine - trainer| {s['logprob_mismatch_max']:.2e} "
                          f"(over the whole vocabulary: {s['untruncated_mismatch_max']:.3f})")
                    assert s["untruncated_mismatch_max"] > 100 * MATCH, s["untruncated_mismatch_max"]
                assert all(len(tokens) > 0 for _, _, tokens, _ in s["samples"])


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_each_prompts_samples_are_handed_over_as_they_finish(llama_tp2, qwen2_dp2, engine):
    """``on_group``: on every rank, each prompt of its engine's slice once, with its n samples as returned."""
    for ranks in (llama_tp2, qwen2_dp2):
        for per_rank in _steps(ranks, engine):
            for s in per_rank:
                groups = s["groups"]
                assert sorted(g[0][0] for g in groups) == s["engine_prompts"]
                assert all(len(g) == 2 and {x[0] for x in g} == {g[0][0]} for g in groups)
                by_prompt = sorted((x for g in groups for x in g), key=lambda x: (x[0], x[1]))
                assert [tuple(x) for x in by_prompt] == [tuple(x) for x in s["samples"] if x[0] in s["engine_prompts"]]


def test_vllm_ranks_of_one_engine_return_identical_tokens(llama_tp2):
    a, b = _steps(llama_tp2, "vllm")
    for sa, sb in zip(a, b):
        assert sa["samples"] == sb["samples"] and len(sa["samples"]) == 4 * 2


def test_fixed_long_sequence_changes_and_matches_the_actor(llama_tp2):
    for per_rank in _steps(llama_tp2, "vllm"):
        s = next(s for s in per_rank if s["temperature"] == 1.0)
        assert s["fixed_change_max"] > 1e-2  # the update reached the engine
        assert s["fixed_vs_train_max"] <= MATCH


def test_two_engines_generate_different_slices_and_every_dp_rank_gets_its_share(qwen2_dp2):
    steps = _steps(qwen2_dp2, "vllm")
    engine_prompts = [per_rank[0]["engine_prompts"] for per_rank in steps]
    assert engine_prompts[0] == engine_prompts[1] and engine_prompts[2] == engine_prompts[3]
    assert set(engine_prompts[0]).isdisjoint(engine_prompts[2])
    assert sorted(engine_prompts[0] + engine_prompts[2]) == [0, 1, 2, 3]
    for per_rank in steps:  # every rank sees all samples, identical everywhere
        assert per_rank[0]["samples"] == steps[0][0]["samples"]
        assert {p for p, _, _, _ in per_rank[0]["samples"]} == {0, 1, 2, 3}
    for rank in qwen2_dp2:
        share = _steps([rank], "vllm")[0][0]["dp_prompts"]
        assert share == ([0, 1] if rank["dp_rank"] == 0 else [2, 3])


def test_unsynced_update_is_flagged_by_the_mismatch_metric(llama_tp2, qwen2_dp2):
    for ranks in (llama_tp2, qwen2_dp2):
        for r in ranks:
            assert r["stale"]["logprob_mismatch_max"] > 100 * MATCH, r["stale"]


def test_vllm_temperature_zero_is_greedy(llama_tp2, qwen2_dp2):
    for ranks in (llama_tp2, qwen2_dp2):
        assert all(r["vllm_greedy_gap"] <= 1e-4 for r in ranks), [r["vllm_greedy_gap"] for r in ranks]


def test_hf_engine_frees_its_model_after_rollout(llama_tp2):
    assert all(r["hf_freed"] for r in llama_tp2)


def test_cpu_sleep_is_said_once_and_overlong_prompts_are_refused(llama_tp2):
    for r in llama_tp2:  # 3 sleeps on each rank, said once: by rank 0 (every rank's engine is the same)
        assert len(r["sleep_messages"]) == (r["rank"] == 0) and all("no sleep mode" in m for m in r["sleep_messages"])
        assert "prompt 0 has 510 tokens" in r["too_long"] and "rollout.max_model_len=512" in r["too_long"]


def test_a_batch_longer_than_an_engine_step_is_generated_whole(llama_tp2):
    """24 seeded prompts of 500 tokens, more than one CPU engine step's 8192: every prompt gets its sample (vLLM's
    chunked prefill killed the CPU engine here: "CPU Generator does not use offset"); the engine's ranks agree."""
    for r in llama_tp2:
        assert r["long_batch"] == [[i, 500, True] for i in range(24)]
    assert llama_tp2[0]["long_batch"] == llama_tp2[1]["long_batch"]


def test_partial_rollout_continues_in_flight_requests_under_the_new_weights(llama_tp2, qwen2_dp2):
    """Streaming (``megarl.rollout.stream``) with a weight push after a fixed engine step while requests are in
    flight: some samples hold tokens of both versions; each token's log-prob is the teacher-forced HF log-prob (fp32)
    of the version that produced it, before and after the switch; the prompts exceed the CPU block size and one
    submitted after the push shares a full block with an earlier one (no stale prefix cache). An engine's ranks
    agree on every token."""
    for ranks in (llama_tp2, qwen2_dp2):
        for r in ranks:
            p = r["partial"]
            assert p["in_flight_at_push"] >= 2  # samples mid-answer at the push
            assert p["err_old"] <= MATCH and p["err_new"] <= MATCH, p
            both = [v for v in p["versions"] if set(v) == {10, 11}]
            assert len(both) >= 2 and all(v == sorted(v) and v.count(10) == 5 for v in both), p["versions"]
            assert sorted(p["serials"]) == [0, 0, 1, 1, 2, 2]
            assert all(set(v) == {11} for v, s in zip(p["versions"], p["serials"]) if s == 2)  # admitted after
        assert all(r["partial"]["tokens"] == ranks[0]["partial"]["tokens"] for r in ranks)


def test_requests_in_flight_saved_and_continued_by_a_new_session(llama_tp2):
    """A snapshot of requests 4 engine steps in (a checkpoint), the requests dropped (the run dies), a new session
    restores them: each continues its own tokens (prompt + tokens so far resubmitted, the budget left), with the
    new weights' log-probs, and nothing is left in the engine."""
    for r in llama_tp2:
        p = r["partial"]["resumed"]
        assert len(p["saved_tokens"]) == 2 and all(len(t) == 4 for t in p["saved_tokens"])
        assert len(p["tokens"]) == 2 and all(t[:4] == s for t, s in zip(p["tokens"], p["saved_tokens"]))
        assert all(4 < len(t) <= 12 for t in p["tokens"]) and p["err"] <= MATCH and not p["busy_after"]
    assert llama_tp2[0]["partial"]["resumed"] == llama_tp2[1]["partial"]["resumed"]
