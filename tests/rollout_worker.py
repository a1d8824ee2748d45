"""Run under torchrun by tests/test_rollout.py: a Megatron actor, a colocated vLLM engine and an HF engine per rank.

    torchrun --standalone --nproc-per-node N tests/rollout_worker.py '<json args>'

Each rank writes what it saw to ``<out>/rank<r>.json``; the test asserts on those files.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist

from megarl.backend.logprobs import logprob_mismatch, token_logprobs
from megarl.backend.setup import wrap_for_training
from megarl.backend.step import lm_loss, make_lm_micro_batches, train_step
from megarl.config.schema import OptimConfig, RolloutConfig, SamplingConfig
from megarl.convert.hf_to_megatron import load_hf_into_chunk
from megarl.models import read_hf_config, spec_from_hf_config
from megarl.models.builder import build_model_chunk
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout, prompt_slice
from megarl.reshard.layout import megatron_layout
from megarl.reshard.sync import actor_tensors
from megarl.rollout import write_engine_dir
from megarl.rollout.hf_engine import HFEngine
from megarl.rollout.protocol import rollout, samples_for_dp_rank
from megarl.rollout.stream import StreamSession, stream_seed
from megarl.rollout.vllm_engine import VLLMEngine

CFG = RolloutConfig(kv_cache_mb=32, max_model_len=512, bucket_mb=1)


def _tokens(n: int, seed: int) -> list[int]:
    return [int(x) for x in torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed))]


def main(args: dict) -> None:
    tp, pp, dp = args["megatron"]
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    init_distributed(layout, seed=11)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank = layout.coords(rank).dp
    hf_dir, rollout_tp = args["hf_dir"], args["rollout_tp"]
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    chunk = build_model_chunk(spec, layout, init_weights=False)
    load_hf_into_chunk(chunk, hf_dir, spec, layout, rank, progress=False)
    ddp, optimizer = wrap_for_training(chunk, OptimConfig(optimizer="adam", lr=1e-2, clip_grad=0.0))
    src_layout = megatron_layout(spec, layout, gpus_per_node=world)
    engine_dir = os.path.join(args["out"], "engine")  # config + tokenizer only: weights come through the sync
    if rank == 0:
        write_engine_dir(read_hf_config(hf_dir), hf_dir, engine_dir)
    dist.barrier()
    assert not any(f.endswith(".safetensors") for f in os.listdir(engine_dir))
    engines = {
        "vllm": VLLMEngine(CFG, engine_dir, spec, src_layout, tp=rollout_tp),
        "hf": HFEngine(CFG, engine_dir, spec, src_layout),
    }
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megarl.rollout").addHandler(handler)
    fixed = _tokens(180, 0)  # longer than the CPU KV block (128): a stale prefix cache would show
    prompts = [_tokens(200, 1), _tokens(12, 2), _tokens(150, 3), _tokens(7, 4)]
    out = {"rank": rank, "dp_rank": dp_rank, "version_steps": []}

    def train_once(seed):
        gen = torch.Generator().manual_seed(100 * seed + dp_rank)
        batch = torch.randint(3, 259, (2, 33), generator=gen)
        train_step(ddp, optimizer, make_lm_micro_batches(batch, 1), lm_loss)

    def recompute(samples, temperature, top_k=0, top_p=1.0):
        return [
            token_logprobs(ddp, torch.tensor([s.prompt_ids + s.token_ids]), temperature=temperature,
                           true_vocab=spec.vocab_size, top_k=top_k, top_p=top_p)[0, len(s.prompt_ids) - 1 :]
            for s in samples
        ]  # fmt: skip

    engines["vllm"].update_weights(actor_tensors(ddp), 0)
    fixed_before = engines["vllm"].score(fixed)
    train_once(1)  # the actor update
    version = 1
    for name, engine in engines.items():
        report = engine.update_weights(actor_tensors(ddp), version)
        for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 20, 0.8)):
            torch.manual_seed(1000 * rank + 17)  # global RNGs differ on every rank before the call
            sampling = SamplingConfig(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=8,
                                      seed=5)  # fmt: skip
            groups = []  # what the engine handed over as each prompt's samples finished
            samples, stats = rollout(engine, prompts, step=version, sampling=sampling, seed=0, on_group=groups.append)
            mine = samples_for_dp_rank(samples, dp_rank, dp)
            entry = {
                "engine": name,
                "temperature": temperature,
                "engine_prompts": list(prompt_slice(len(prompts), rank // engine.tp, world // engine.tp)),
                "samples": [(s.prompt_index, s.sample_index, s.token_ids, s.finish_reason) for s in samples],
                "dp_prompts": sorted({s.prompt_index for s in mine}),
                "versions": sorted({s.weight_version for s in samples}),
                "groups": [[(s.prompt_index, s.sample_index, s.token_ids, s.finish_reason) for s in g] for g in groups],
                "tokens_per_s": stats.tokens_per_s,
                "sync_seconds": report.seconds,
                "truncated": bool(top_k),
                **logprob_mismatch([s.logprobs for s in mine], recompute(mine, temperature, top_k, top_p)),
            }
            if top_k:  # the engine's log-probs are of the truncated softmax: over the whole vocabulary they differ
                full = logprob_mismatch([s.logprobs for s in mine], recompute(mine, temperature))
                entry["untruncated_mismatch_max"] = full["logprob_mismatch_max"]
            if name == "vllm" and temperature == 1.0:
                train_fixed = token_logprobs(ddp, torch.tensor([fixed]), temperature=1.0, true_vocab=spec.vocab_size)
                after = torch.tensor(engines["vllm"].score(fixed), dtype=torch.float64)
                entry["fixed_vs_train_max"] = float((after - train_fixed[0].double()).abs().max())
                entry["fixed_change_max"] = float((after - torch.tensor(fixed_before, dtype=torch.float64)).abs().max())
            out["version_steps"].append(entry)
        engine.sleep()  # HF: frees its model; vLLM on CPU: logged no-op
    out["hf_freed"] = engines["hf"].resident_bytes() == 0

    # greedy (val_sampling.temperature=0): vLLM's tokens are the argmax of the same weights' logits (HF's forward)
    engines["hf"].update_weights(actor_tensors(ddp), version)  # back from its sleep, holding what vLLM holds
    greedy = SamplingConfig(n=1, temperature=0, max_new_tokens=8, seed=5)
    gap = 0.0
    for s in rollout(engines["vllm"], prompts, step=version, sampling=greedy, seed=0)[0]:
        with torch.no_grad():
            logits = engines["hf"].model(torch.tensor([s.prompt_ids + s.token_ids])).logits
        logits = logits[0, len(s.prompt_ids) - 1 : -1]
        chosen = logits.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        gap = max(gap, float((logits.max(-1).values - chosen).max()))
    out["vllm_greedy_gap"] = gap  # 0 when every token is the argmax (up to the engines' float differences)
    engines["hf"].sleep()

    # an actor update that is not synced: the mismatch metric must flag it
    train_once(2)
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    samples, _ = rollout(engines["vllm"], prompts, step=2, sampling=sampling, seed=0)
    mine = samples_for_dp_rank(samples, dp_rank, dp)
    out["stale"] = logprob_mismatch([s.logprobs for s in mine], recompute(mine, 1.0))

    # CPU: no sleep mode, said once; a request that cannot fit max_model_len is refused before vLLM sees it
    engines["vllm"].sleep()
    engines["vllm"].sleep()
    engines["vllm"].wake()
    out["sleep_messages"] = [r.getMessage() for r in records]
    try:
        engines["vllm"].generate([_tokens(510, 9)], [0], [1], sampling)
        out["too_long"] = None
    except ValueError as e:
        out["too_long"] = str(e)

    # more prompt tokens than one CPU engine step holds (8192): each prompt is prefilled whole (vLLM's chunked prefill
    # rewinds a seeded request's generator after a partial prefill, which a CPU generator refuses: the engine died)
    long_batch = [_tokens(500, 20 + i) for i in range(24)]
    samples, _ = rollout(engines["vllm"], long_batch, step=3, sampling=SamplingConfig(n=1, max_new_tokens=4, seed=5),
                         seed=0)  # fmt: skip
    out["long_batch"] = sorted((s.prompt_index, len(s.prompt_ids), len(s.token_ids) == 4 or s.finish_reason == "stop")
                               for s in samples)  # fmt: skip

    out["partial"] = partial_rollout(engines["vllm"], engines["hf"], ddp, train_once)

    with open(os.path.join(args["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()


def partial_rollout(vllm, hf, ddp, train_once) -> dict:
    """Streaming with a weight push between two engine steps while requests are in flight (partial rollout,
    ``recompute``): each token's log-prob against teacher-forced HF log-probs (fp32) of the version that produced it.
    The prompts exceed the CPU block size (128 tokens) and a prompt submitted after the push shares a full block
    with one submitted before it: a stale prefix cache would serve the old weights' keys and values."""
    temperature = 0.8

    def teacher_forced(seq: list[int], prompt_len: int) -> list[float]:
        with torch.no_grad():
            logits = hf.model(torch.tensor([seq])).logits[0].float() / temperature
        lp = torch.log_softmax(logits, -1)
        return [float(lp[prompt_len - 1 + j, seq[prompt_len + j]]) for j in range(len(seq) - prompt_len)]

    first = _tokens(200, 21)
    vllm.update_weights(actor_tensors(ddp), 10)
    session = StreamSession(vllm, SamplingConfig(n=2, temperature=temperature, max_new_tokens=12))
    session.submit(0, first, seed=stream_seed(7, 0, 2))
    session.submit(1, _tokens(150, 22), seed=stream_seed(7, 1, 2))
    groups = []
    for _ in range(PUSH_AT_STEP):
        groups += session.step()
    in_flight = session.in_flight
    hf.update_weights(actor_tensors(ddp), 10)
    old = {k: v.clone() for k, v in hf.model.state_dict().items()}
    train_once(3)
    vllm.update_weights(actor_tensors(ddp), 11)  # pre-empts the requests in flight: they recompute
    hf.update_weights(actor_tensors(ddp), 11)
    new = {k: v.clone() for k, v in hf.model.state_dict().items()}
    session.submit(2, first[:129] + _tokens(30, 23), seed=stream_seed(7, 2, 2))  # the first's first block
    groups += session.drain()
    errors = {10: 0.0, 11: 0.0}
    for weights, version in ((old, 10), (new, 11)):
        hf.model.load_state_dict(weights)
        for s in (s for g in groups for s in g):
            tf = teacher_forced(s.prompt_ids + s.token_ids, len(s.prompt_ids))
            for lp, ref, v in zip(s.logprobs, tf, s.weight_versions):
                if v == version:
                    errors[version] = max(errors[version], abs(lp - ref))
    samples = [s for g in groups for s in g]

    # a checkpoint of requests in flight, continued by a new session (a resume): prompt + tokens so far, the budget
    # left, a new seed segment; the weights are version 11 throughout (hf holds them: loaded last above)
    sampling = SamplingConfig(n=2, temperature=temperature, max_new_tokens=12)
    before = StreamSession(vllm, sampling)
    before.submit(5, first, seed=stream_seed(7, 5, 2))
    for _ in range(4):
        before.step()
    saved = before.snapshot()
    vllm.abort(list(before.requests))  # the run dies here
    after = StreamSession(vllm, sampling)
    after.restore(saved, lambda serial, segment: stream_seed(7, serial, 2, segment))
    resumed = [s for g in after.drain() for s in g]
    resumed_err = 0.0
    for s in resumed:
        tf = teacher_forced(s.prompt_ids + s.token_ids, len(s.prompt_ids))
        resumed_err = max(resumed_err, max(abs(a - b) for a, b in zip(s.logprobs, tf)))
    return {
        "resumed": {
            "saved_tokens": [r["token_ids"] for r in saved],
            "tokens": [s.token_ids for s in resumed],
            "segments": [r.segment for r in after.requests.values()],
            "err": resumed_err,
            "busy_after": vllm.busy,
        },
        "in_flight_at_push": in_flight,
        "err_old": errors[10],
        "err_new": errors[11],
        "versions": [s.weight_versions for s in samples],
        "serials": [s.prompt_index for s in samples],
        "tokens": [s.token_ids for s in samples],
        "engine_steps": session.steps,
    }


PUSH_AT_STEP = 5
"""The engine step after which the weights are pushed (a fixed schedule: the test is deterministic)."""


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
