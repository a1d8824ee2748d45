"""The engine's routed experts (``megarl.rollout.routes``) without an engine: the CPU recorder's bookkeeping over
engine steps, and vLLM's CUDA output (a stand-in ``CompletionOutput`` with ``routed_experts``) giving the same
``Sample.routed_experts``. The recorder on a real vLLM engine: tests/test_vllm_sync.py."""

import numpy as np
import pytest
import torch

from megarl.rollout.routes import RouteRecorder, completion_routes, routes_dtype
from megarl.rollout.vllm_engine import finished_samples

K, LAYERS, EXPERTS = 2, 2, 8


def _truth(request: int, positions: int) -> torch.Tensor:
    """The experts 'routed' at each position of a request: [positions, layers, k], distinct per request."""
    gen = torch.Generator().manual_seed(request)
    return torch.stack([torch.randperm(EXPERTS, generator=gen)[:K] for _ in range(positions * LAYERS)]).view(
        positions, LAYERS, K
    )


def _step(recorder: RouteRecorder, batch: list[tuple[str, int, int]], truth: dict, junk: bool = False) -> None:
    """An engine step over ``batch`` ((engine id, start position, tokens)): each layer's capture, then the layout.
    ``junk``: the rows a recomputed position gets differ (new weights) and must not replace the first ones."""
    rows = [truth[eid.rsplit("-", 1)[0]][start : start + n] for eid, start, n in batch]
    step = torch.cat(rows)
    if junk:
        step = (step + 1) % EXPERTS
    recorder.capture(0, torch.zeros(3, K, dtype=torch.int64))  # a dummy forward before the step's: overwritten
    for layer in range(LAYERS):
        recorder.capture(layer, step[:, layer].to(torch.int64))
    recorder.step([eid for eid, _, _ in batch], [n for _, _, n in batch], [start for _, start, _ in batch])


def test_the_recorder_files_each_position_once_across_chunks_interleaving_and_a_re_prefill():
    truth = {"a": _truth(1, 30), "b": _truth(2, 12), "c": _truth(3, 9)}
    rec = RouteRecorder(EXPERTS)
    _step(rec, [("a-1f2e3d4c", 0, 20), ("b-00aa11bb", 0, 10)], truth)  # prefills
    _step(rec, [("b-00aa11bb", 10, 1), ("a-1f2e3d4c", 20, 1), ("c-99887766", 0, 5)], truth)  # another order
    # pre-empted by a weight push: prefilled again (the new weights route differently) with the token sampled last,
    # whose position is computed for the first time here
    _step(rec, [("a-1f2e3d4c", 0, 22), ("c-99887766", 0, 6)], truth, junk=True)
    _step(rec, [("a-1f2e3d4c", 22, 8), ("c-99887766", 6, 3), ("b-00aa11bb", 11, 1)], truth)
    for name, first_new in (("a", 21), ("c", 5)):
        truth[name][first_new] = (truth[name][first_new] + 1) % EXPERTS
    assert torch.equal(rec.take("a", 30), truth["a"].to(torch.uint8))
    assert torch.equal(rec.take("c", 8), truth["c"][:8].to(torch.uint8))  # P + G - 1 of the 9 recorded
    with pytest.raises(RuntimeError, match="12 positions recorded, 13 computed"):
        rec.take("b", 13)
    assert not rec.rows and not rec.count  # taken (and the failed one) forgotten
    _step(rec, [("d-12345678", 0, 4)], {"d": _truth(4, 4)})
    with pytest.raises(RuntimeError, match="positions 4..5 were never computed"):
        _step(rec, [("d-12345678", 6, 1)], {"d": _truth(4, 7)})
    rec.forget(["d"])
    assert not rec.rows and routes_dtype(256) == torch.uint8 and routes_dtype(257) == torch.int32


class _Out:
    """A finished ``RequestOutput``: its id and completions."""

    def __init__(self, request_id, outputs):
        self.request_id, self.outputs = request_id, outputs


def test_cuda_output_and_the_cpu_recorder_give_the_same_sample_routes():
    """vLLM's ``CompletionOutput.routed_experts`` is [positions, every hidden layer, k]: with a dense layer between
    two MoE layers (hidden layers 0 and 2), the sample keeps columns 0 and 2, equal to what the CPU recorder gives
    for the same routing; a request of n = 2 samples is recorded under 'j_<id>'."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    prompt, tokens = [5, 6, 7, 8], [[9, 10, 11], [12, 13]]
    moe = {j: _truth(10 + j, len(prompt) + len(t) - 1) for j, t in enumerate(tokens)}
    rec = RouteRecorder(EXPERTS)
    for j, t in enumerate(tokens):
        _step(rec, [(f"{j}_7-abcdef01", 0, len(prompt) + len(t) - 1)], {f"{j}_7": moe[j]})

    def completion(j, t, routed):
        logprobs = [{tok: Logprob(-0.5)} for tok in t]
        return CompletionOutput(j, "", t, None, logprobs, routed_experts=routed, finish_reason="length")

    dense = np.full((len(prompt) + 2, 1, K), 255, dtype=np.uint8)
    hidden = {j: np.concatenate([moe[j][:, :1].numpy(), dense[: len(moe[j])], moe[j][:, 1:].numpy()], axis=1)
              for j in moe}  # fmt: skip
    cuda = finished_samples(_Out("7", [completion(j, t, hidden[j]) for j, t in enumerate(tokens)]), 3, prompt, 5,
                            routes=lambda rid, n, c: completion_routes(c.routed_experts, [0, 2], EXPERTS))  # fmt: skip
    cpu = finished_samples(_Out("7", [completion(j, t, None) for j, t in enumerate(tokens)]), 3, prompt, 5,
                           routes=lambda rid, n, c: rec.take(rid, n))  # fmt: skip
    for a, b, j in zip(cuda, cpu, moe):
        assert a.routed_experts.dtype == torch.uint8 and torch.equal(a.routed_experts, b.routed_experts)
        assert torch.equal(a.routed_experts, moe[j].to(torch.uint8)) and a.weight_versions == [5] * len(a.token_ids)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf_model

    return make_tiny_hf_model(str(tmp_path_factory.mktemp("routes") / "moe"), "qwen3_moe")


def test_cuda_routes_of_a_streamed_request_continued_after_a_resume_keep_their_earlier_rows():
    """CUDA (vLLM reports a request's rows when it finishes): a request resumed from a checkpoint as prompt + tokens
    so far is reported again from position 0; the rows saved before the checkpoint stand, the new ones follow."""
    from megarl.rollout.routes import EngineRoutes

    routes, first, again = EngineRoutes(None, [0, 2], EXPERTS), _truth(1, 12), _truth(2, 16)

    class Done:
        routed_experts = np.concatenate([again[:, :1].numpy(), again[:, :1].numpy(), again[:, 1:].numpy()], 1)

    routes.resume("3.1", first[:9].to(torch.uint8))
    assert torch.equal(routes.so_far("3.1"), first[:9].to(torch.uint8))
    routes.finished("3.1", Done())
    got = routes.take("3.1", 15)
    assert torch.equal(got[:9], first[:9].to(torch.uint8)) and torch.equal(got[9:], again[9:15].to(torch.uint8))
    routes.forget(["3.1"])
    assert routes.so_far("3.1") is None and not routes.reported


def test_routing_replay_is_refused_in_one_line_where_samples_cannot_carry_routes(tiny_llama_dir, tiny_moe_dir):
    from megarl.config import ConfigError, load_config, validate

    def refusal(recipe, *overrides, world=2):
        with pytest.raises(ConfigError) as e:
            validate(load_config(recipe, list(overrides)), world_size=world)
        return str(e.value)

    moe = [f"model.path={tiny_moe_dir}", "actor.moe_routing_replay=rollout"]
    assert refusal("configs/tiny_grpo.yaml", f"model.path={tiny_llama_dir}", "actor.moe_routing_replay=measure") == (
        "actor.moe_routing_replay=measure: llama has no routed experts; use off")
    assert "must be one of ('off', 'measure', 'rollout'), got 'always'" in refusal(
        "configs/tiny_grpo_qwen3_moe.yaml", f"model.path={tiny_moe_dir}", "actor.moe_routing_replay=always")
    assert refusal("configs/tiny_grpo_qwen3_moe.yaml", *moe, "rollout.backend=hf") == (
        "actor.moe_routing_replay=rollout needs rollout.backend=vllm (the HF engine does not report the experts it "
        "routed to)")
    assert "an episode's turns do not carry their routes yet" in refusal(
        "configs/tiny_grpo_qwen3_moe.yaml", *moe, "env.class=tests/envs.py:AlwaysCalls", "env.max_total_tokens=64")
    for mode in ("off", "measure", "rollout"):
        validate(load_config("configs/tiny_grpo_qwen3_moe.yaml", [f"model.path={tiny_moe_dir}",
                                                                 f"actor.moe_routing_replay={mode}"]), world_size=2)
    validate(load_config("configs/tiny_grpo_bounded.yaml", [*moe, "actor.parallel.tp=1", "actor.parallel.dp=2"]),
             world_size=4)
