"""Runs inside each of 4 spawned ranks: pool-local default process groups, Megatron TP=2 on the train pool (ranks
0-1) and one vLLM engine at TP=2 on the rollout pool (ranks 2-3, external launcher). Each rank writes what it saw to
``<out>/rank<r>.pt``; the test compares the pools' log-probabilities with each other and with transformers."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from megarl.parallel.layout import Pool
from megarl.parallel.pools import init_pool_group, pool_rank_env

POOLS = [Pool("train", range(0, 2), ("actor",)), Pool("rollout", range(2, 4), ("rollout",))]


def run_pools(hf_dir: str, out_dir: str, prompt: list[int], new_tokens: int) -> None:
    """The engine starts with random weights; the actor's reach it through the resharding planner across the pools
    (two emulated nodes: the train pool on node 0, the rollout pool on node 1)."""
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.parallel.comm import GroupComm
    from megarl.parallel.layout import ParallelLayout
    from megarl.parallel.pools import launch_store
    from megarl.reshard.executor import ReshardVerificationError
    from megarl.reshard.layout import megatron_layout, vllm_layout
    from megarl.reshard.plan import plan, theoretical_minimum
    from megarl.reshard.sync import run_sync, split_by_layer

    rank = int(os.environ["RANK"])
    pool = init_pool_group(POOLS, "gloo")
    out = {"pool": pool.name, "pool_rank": dist.get_rank(), "pool_world": dist.get_world_size()}
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    layout = ParallelLayout(tp=2)
    src, dst = megatron_layout(spec, layout, 2), vllm_layout(spec, 2, 2, 2).shifted(2)  # 2 ranks per node
    sub_plans = split_by_layer(plan(src, dst))
    out["lower_bounds"] = theoretical_minimum(src, dst, 4)
    across = GroupComm("sync", launch_store(), rank, 4)

    def corrupt(t, piece):
        if t.hf.endswith("mlp.up_proj.weight"):
            piece[0] += 1.0

    if pool.name == "train":
        from megatron.core import parallel_state as ps

        from megarl.backend.logprobs import token_logprobs
        from megarl.convert.hf_to_megatron import load_hf_into_chunk
        from megarl.models.builder import build_model_chunk
        from megarl.parallel.init import init_distributed
        from megarl.reshard.sync import actor_tensors

        init_distributed(layout, seed=1)
        chunk = build_model_chunk(spec, layout, init_weights=False)
        load_hf_into_chunk(chunk, hf_dir, spec, layout, dist.get_rank(), progress=False)
        out["tp_group"] = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
        out["vllm_imported"] = "vllm" in sys.modules

        def sync(on_send=None):
            return run_sync(sub_plans, actor_tensors(chunk), None, comm=across, dtype=torch.float32,
                            bucket_bytes=1024**2, on_send=on_send)  # fmt: skip
    else:
        from vllm import SamplingParams

        from megarl import lifetime
        from megarl.compat import vllm_shm
        from megarl.reshard.transport import ShardWrite
        from megarl.rollout.vllm_engine import preserved_process_state

        vllm_shm.install(f"{lifetime.shm_prefix()}-{pool.name}")  # the pool-local TP ranks alone would collide
        with pool_rank_env(pool, rank), preserved_process_state():
            from vllm import LLM

            llm = LLM(model=hf_dir, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
                      dtype="float32", seed=0, enforce_eager=True, kv_cache_memory_bytes=32 * 1024**2,
                      max_model_len=512, logprobs_mode="processed_logprobs", load_format="dummy")  # fmt: skip
        writer = ShardWrite(llm, spec, 2, torch.float32)

        def sync(on_send=None):
            report = run_sync(sub_plans, {}, writer, comm=across, bucket_bytes=1024**2, on_send=on_send)
            llm.reset_prefix_cache()
            return report

    out["report"] = sync()
    try:
        sync(corrupt)
        out["corrupt"] = None
    except ReshardVerificationError as e:
        out["corrupt"] = str(e)
    sync()  # a good sync after the corrupted one
    if pool.name == "rollout":
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=1234, logprobs=0)
        c = llm.generate([{"prompt_token_ids": prompt}], sampling_params=params, use_tqdm=False)[0].outputs[0]
        out["tokens"] = list(c.token_ids)
        out["logprobs"] = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
        out["megatron_built"] = "megatron.core.parallel_state" in sys.modules and _mcore_initialized()
        out["vllm_world"] = _vllm_world()
    tokens = across.broadcast_object(out.get("tokens"), src=2)  # the rollout pool's tokens, scored by the actor
    if pool.name == "train":
        ids = torch.tensor([prompt + tokens])
        out["actor_logprobs"] = token_logprobs(chunk, ids, temperature=1.0, true_vocab=spec.vocab_size)[
            0, len(prompt) - 1 :
        ].tolist()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _mcore_initialized() -> bool:
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized()


def _vllm_world() -> list[int]:
    from vllm.distributed import parallel_state as vps

    return list(vps.get_world_group().ranks)
