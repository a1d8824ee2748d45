"""Runs inside each of 2 spawned ranks: every reward model of the test at TP=2, then at TP=1 x DP=2; each rank writes
its scores to ``<out>/rank<r>.pt``. Then every model is converted to a megarl checkpoint at TP=2 and exported back
to HF (``<out>/<name>-megarl``, ``<out>/<name>-hf``)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def run_reward_models(models: dict[str, str], sequences: list[list[int]], out_dir: str) -> None:
    from megarl.backend.batch import Batching
    from megarl.convert.hf_to_megatron import load_hf_into_chunk
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.builder import build_model_chunk
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rewards.model import reward_model_scores

    out = {}
    for name, layout in (("tp2", ParallelLayout(tp=2)), ("tp1_dp2", ParallelLayout(dp=2))):
        init_distributed(layout, seed=1)
        for model_name, hf_dir in models.items():
            hf = read_hf_config(hf_dir)
            spec = spec_from_hf_config(hf)
            chunk = build_model_chunk(spec, layout, init_weights=False).eval()
            load_hf_into_chunk(chunk, hf_dir, spec, layout, dist.get_rank(), progress=False)
            out[("params", name, model_name)] = sum(p.numel() for p in chunk.parameters())
            out[(name, model_name)] = reward_model_scores(chunk, sequences, hf.get("pad_token_id"),
                                                          Batching(len(sequences), 0, 2))  # fmt: skip
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    from megarl.convert.hf_to_megatron import convert_hf_to_megatron
    from megarl.convert.megatron_to_hf import convert_megatron_to_hf
    from megarl.convert.verify import verify_checkpoint

    verified = {}
    for model_name, hf_dir in models.items():
        megarl_dir = os.path.join(out_dir, f"{model_name}-megarl")
        convert_hf_to_megatron(hf_dir, megarl_dir, ParallelLayout(tp=2))
        verified[model_name] = verify_checkpoint(hf_dir, megarl_dir, ParallelLayout(tp=2))
        convert_megatron_to_hf(megarl_dir, os.path.join(out_dir, f"{model_name}-hf"), ParallelLayout(dp=2))
    if dist.get_rank() == 0:
        torch.save(verified, os.path.join(out_dir, "verified.pt"))
