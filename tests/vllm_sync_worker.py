"""Runs inside each spawned rank: a real Megatron actor and a real colocated vLLM engine (CPU build), weights moved
by the resharding engine through both transports. The parent compares against HF models holding the same weights."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.config.schema import RolloutConfig, SamplingConfig
from megarl.convert.hf_io import HFWeights
from megarl.convert.hf_to_megatron import load_hf_into_chunk
from megarl.models import read_hf_config, spec_from_hf_config
from megarl.models.builder import build_model_chunk
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.reshard.executor import ReshardVerificationError
from megarl.reshard.layout import megatron_layout, vllm_layout
from megarl.reshard.sync import actor_tensors
from megarl.reshard.transport import vllm_model
from megarl.rollout.protocol import EngineUnhealthyError
from megarl.rollout.vllm_engine import VLLMEngine
from tests.reshard_worker import expected_vllm

ROLLOUT = RolloutConfig(kv_cache_mb=32, max_model_len=512, bucket_mb=1)
GEN = SamplingConfig(temperature=1.0, max_new_tokens=8)
BOTH_TRANSPORTS = ((1, "shard_write"), (2, "full_reload"), (1, "full_reload"), (2, "shard_write"))


def _everyone(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _routes_against_the_actor(engine, chunk, spec, long_prompt: list[int]) -> dict:
    """Two samples of three prompts (one longer than a KV block): each sample's routes have a row per computed
    position (P + G - 1), and for how many (position, MoE layer) pairs the actor's router, fed the same tokens,
    picks the same set of experts as the engine did."""
    prompts = [long_prompt, long_prompt[:7], long_prompt[40:75]]
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8)
    samples, _ = engine.generate(prompts, [0, 1, 2], [11, 12, 13], sampling)
    rows_ok, agree, total = [], 0, 0
    for s in samples:
        seq = s.prompt_ids + s.token_ids
        mine, theirs = _own_routes(chunk, spec, seq), s.routed_experts.long().sort(dim=-1).values
        rows_ok.append(tuple(theirs.shape) == (len(seq) - 1, mine.shape[1], spec.moe_top_k))
        agree += int((mine == theirs).all(dim=-1).sum())
        total += mine.shape[0] * mine.shape[1]
    return {"rows_ok": rows_ok, "agree": agree, "total": total, "dtype": str(samples[0].routed_experts.dtype),
            "samples": len(samples)}  # fmt: skip


def _own_routes(chunk, spec, seq: list[int]) -> torch.Tensor:
    """The experts the Megatron actor's routers pick for each input position of ``seq``: [len - 1, layers, k]."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megarl.backend.logprobs import token_logprobs

    picked = []
    hooks = [m.register_forward_hook(lambda mod, args, result: picked.append(result[1]))
             for m in chunk.modules() if isinstance(m, TopKRouter)]  # fmt: skip
    token_logprobs(chunk, torch.tensor([seq]), temperature=1.0, true_vocab=spec.vocab_size)
    for h in hooks:
        h.remove()
    return torch.stack([m.nonzero()[:, 1].view(m.shape[0], -1) for m in picked], dim=1)


def _streamed_routes(engine, chunk, spec, prompt: list[int]) -> dict:
    """Partial rollout: two prompts' samples streamed; after 3 engine steps a snapshot (what a checkpoint holds),
    then a push of other weights (``chunk``'s) pre-empts them, and they prefill again under those and finish. Per
    sample: its rows (P + G - 1?), whether they begin with the snapshot's, and how many of the snapshot's pairs the
    new weights route otherwise (what a re-prefill would have recorded)."""
    from megarl.rollout.stream import StreamSession

    session = StreamSession(engine, SamplingConfig(n=2, temperature=1.0, max_new_tokens=10))
    session.submit(0, prompt[:30], 21)
    session.submit(1, prompt[50:70], 23)
    for _ in range(3):
        session.step()
    before = {f"{r['serial']}.{r['sample_index']}": r["routes"] for r in session.snapshot()}
    engine.update_weights(actor_tensors(chunk), 5)
    samples = [s for group in session.drain() for s in group]
    checks = []
    for s in samples:
        rows, kept = s.routed_experts, before[f"{s.prompt_index}.{s.sample_index}"]
        seq = s.prompt_ids + s.token_ids
        moved = (_own_routes(chunk, spec, seq)[: len(kept)] != kept.long().sort(dim=-1).values).any(-1).sum()
        checks.append({"rows": rows.shape[0], "positions": len(seq) - 1, "kept": torch.equal(rows[: len(kept)], kept),
                       "saved": len(kept), "moved": int(moved), "versions": sorted(set(s.weight_versions))})
    return {"samples": checks}


def run_vllm_sync(
    versions: dict[int, str],
    megatron: tuple[int, ...],
    vllm_tp: int,
    seq: list[int],
    prompt: list[int],
    readable: bool = False,
    steps: tuple[tuple[int, str], ...] = BOTH_TRANSPORTS,
    corrupted: str = "mlp.up_proj.weight",
    routes: bool = False,
) -> dict:
    """Sync versions through the transports of ``steps`` ((version, transport) in order) and record what the engine
    computes after each sync; then a sync with a piece of an HF tensor ending in ``corrupted`` corrupted in transit.

    ``readable``: switch the CPU build's oneDNN packing off (this test only) so parameters can be read back and
    compared with the layout description and the expected shards. A full reload that ``steps`` leaves out is tried
    once and its refusal recorded (``full_reload_refused``). ``routes``: the engine records routed experts, and its
    routes after the last sync are compared with the Megatron actor's own routing (``routes``)."""
    layout = ParallelLayout(*megatron)  # (tp, pp, dp) or (tp, pp, dp, ep)
    init_distributed(layout, seed=7)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = spec_from_hf_config(read_hf_config(versions[1]))
    chunk = build_model_chunk(spec, layout, init_weights=False)
    src_layout = megatron_layout(spec, layout, gpus_per_node=world)
    if readable:
        import vllm._custom_ops as ops

        ops._supports_onednn = False

    torch.manual_seed(1000 + rank)  # the trainer's RNG, different per rank
    rng_before, threads_before = torch.get_rng_state(), torch.get_num_threads()
    engine = VLLMEngine(ROLLOUT, versions[1], spec, src_layout, tp=vllm_tp, seed=0, record_routes=routes)
    out = {
        "rng_restored": _everyone(torch.equal(torch.get_rng_state(), rng_before)),
        "threads_restored": _everyone(torch.get_num_threads() == threads_before),
    }
    try:
        engine.score(seq)
        out["refused_before_sync"] = False
    except EngineUnhealthyError:
        out["refused_before_sync"] = True

    if all(transport != "full_reload" for _, transport in steps):
        try:
            engine.update_weights(actor_tensors(chunk), 1, transport="full_reload")
            out["full_reload_refused"] = None
        except ValueError as e:
            out["full_reload_refused"] = str(e)
    records = []
    for version, transport in steps:
        load_hf_into_chunk(chunk, versions[version], spec, layout, rank, progress=False)
        report = engine.update_weights(actor_tensors(chunk), version, transport=transport)
        torch.manual_seed(5000 + rank)  # diverging global RNGs must not change what the engine's ranks sample
        samples, _ = engine.generate([prompt], [0], [1234], GEN)
        records.append(
            {
                "version": version,
                "transport": transport,
                "score": _everyone(engine.score(seq)),
                "generated": _everyone((samples[0].token_ids, samples[0].logprobs)),
                "report": _everyone(report),
            }
        )
    out["steps"] = records

    def corrupt(t, piece):
        if t.hf.endswith(corrupted):
            piece[0] += 1.0

    try:
        engine.update_weights(actor_tensors(chunk), 3, transport="shard_write", on_send=corrupt)
        out["corrupt"] = None
    except ReshardVerificationError as e:
        out["corrupt"] = str(e)
    out["healthy_after_corrupt"] = engine.healthy
    try:
        engine.score(seq)
        out["refused_after_corrupt"] = False
    except EngineUnhealthyError:
        out["refused_after_corrupt"] = True
    engine.update_weights(actor_tensors(chunk), 4)
    out["score_after_recovery"] = engine.score(seq)
    if routes:
        out["routes"] = _everyone(_routes_against_the_actor(engine, chunk, spec, seq[:150]))
        load_hf_into_chunk(chunk, versions[1], spec, layout, rank, progress=False)  # other weights to push
        out["streamed_routes"] = _everyone(_streamed_routes(engine, chunk, spec, prompt))

    if readable:
        model = vllm_model(engine.llm)
        got = {n: tuple(p.shape) for n, p in model.named_parameters()}
        described = {s.name: tuple(s.shape) for s in vllm_layout(spec, vllm_tp, world, world).ranks[rank]}
        weights = HFWeights(versions[2])
        want = expected_vllm({n: weights.get(n) for n in weights.names}, spec, rank % vllm_tp, vllm_tp)
        params = dict(model.named_parameters())
        out["layout"] = _everyone(
            {
                "engine": got,
                "described": described,
                "unequal": sorted(n for n in want if n not in params or not torch.equal(params[n].data, want[n])),
            }
        )
    return out
