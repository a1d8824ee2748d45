"""Runs inside each of 4 spawned ranks: pool-local default process groups, Megatron TP=2 on the train pool (ranks
0-1) and one vLLM engine at TP=2 on the rollout pool (ranks 2-3, external launcher). Each rank writes what it saw to
``<out>/rank<r>.pt``; the test compares the pools' log-probabilities with each other and with transformers."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from megarl.parallel.pools import Pool, init_pool_group, pool_rank_env

POOLS = [Pool("train", range(0, 2), ("actor",)), Pool("rollout", range(2, 4), ("rollout",))]


def run_pools(hf_dir: str, out_dir: str, prompt: list[int], new_tokens: int) -> None:
    rank = int(os.environ["RANK"])
    pool = init_pool_group(POOLS, "gloo")
    out = {"pool": pool.name, "pool_rank": dist.get_rank(), "pool_world": dist.get_world_size()}
    if pool.name == "train":
        from megatron.core import parallel_state as ps

        from megarl.convert.hf_to_megatron import load_hf_into_chunk
        from megarl.models import read_hf_config, spec_from_hf_config
        from megarl.models.builder import build_model_chunk
        from megarl.parallel.init import init_distributed
        from megarl.parallel.layout import ParallelLayout
        from megarl.training.logprobs import token_logprobs

        layout = ParallelLayout(tp=2)
        init_distributed(layout, seed=1)
        spec = spec_from_hf_config(read_hf_config(hf_dir))
        chunk = build_model_chunk(spec, layout, init_weights=False)
        load_hf_into_chunk(chunk, hf_dir, spec, layout, dist.get_rank(), progress=False)
        out["tp_group"] = dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
        out["megatron_built"] = True
        out["vllm_imported"] = "vllm" in sys.modules
        # the rollout pool's tokens, scored by the actor (no cross-pool group yet: the rollout rank's file)
        while not os.path.exists(os.path.join(out_dir, "rank2.pt")):
            time.sleep(0.2)
        tokens = torch.load(os.path.join(out_dir, "rank2.pt"))["tokens"]
        out["actor_logprobs"] = token_logprobs(
            chunk, torch.tensor([prompt + tokens]), temperature=1.0, true_vocab=spec.vocab_size
        )[0, len(prompt) - 1 :].tolist()
    else:
        from vllm import LLM, SamplingParams

        from megarl.compat import vllm_shm
        from megarl.launch import lifetime
        from megarl.rollout.vllm_engine import preserved_process_state

        vllm_shm.install(f"{lifetime.shm_prefix()}-{pool.name}")  # the pool-local TP ranks alone would collide
        with pool_rank_env(pool, rank), preserved_process_state():
            llm = LLM(model=hf_dir, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
                      dtype="float32", seed=0, enforce_eager=True, kv_cache_memory_bytes=32 * 1024**2,
                      max_model_len=512, logprobs_mode="processed_logprobs")  # fmt: skip
        params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=1234, logprobs=0)
        c = llm.generate([{"prompt_token_ids": prompt}], sampling_params=params, use_tqdm=False)[0].outputs[0]
        out["tokens"] = list(c.token_ids)
        out["logprobs"] = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
        out["megatron_built"] = "megatron.core.parallel_state" in sys.modules and _mcore_initialized()
        out["vllm_world"] = _vllm_world()
        tmp = os.path.join(out_dir, f"rank{rank}.tmp")
        torch.save(out, tmp)
        os.rename(tmp, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        return
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _mcore_initialized() -> bool:
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized()


def _vllm_world() -> list[int]:
    from vllm.distributed import parallel_state as vps

    return list(vps.get_world_group().ranks)
