"""Runs inside each spawned rank: real Megatron chunks (loaded from HF weights) resharded into vLLM / HF layouts.

Expected destination tensors are sliced from the original HF weights by vLLM's rules, written here independently of
megarl.reshard.layout (plain torch chunking), so a wrong layout description cannot agree with itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.convert.hf_io import HFWeights
from megarl.convert.hf_to_megatron import load_hf_into_chunk
from megarl.models import read_hf_config, spec_from_hf_config
from megarl.models.builder import build_model_chunk
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.reshard.executor import ReshardVerificationError, execute
from megarl.reshard.layout import hf_layout, megatron_layout, vllm_layout
from megarl.reshard.plan import plan

GPUS_PER_NODE = 2  # 4 ranks = 2 "nodes": exercises same-node, cross-node and forwarded pieces


def expected_vllm(hf: dict[str, torch.Tensor], spec, r: int, d: int) -> dict[str, torch.Tensor]:
    h, hd, nkv = spec.hidden_size, spec.head_dim, spec.num_kv_heads
    vpad = -(-spec.vocab_size // 64) * 64

    def vocab(w):
        padded = torch.zeros(vpad, h, dtype=w.dtype)
        padded[: spec.vocab_size] = w
        return padded.chunk(d)[r]

    def kv(w):
        return w.chunk(d)[r] if d <= nkv else w.reshape(nkv, hd, *w.shape[1:])[r // (d // nkv)]

    out = {
        "model.embed_tokens.weight": vocab(hf["model.embed_tokens.weight"]),
        "model.norm.weight": hf["model.norm.weight"],
    }
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = vocab(hf["lm_head.weight"])
    for i in range(spec.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        for s in ("weight", "bias") if spec.qkv_bias else ("weight",):
            out[a + f"qkv_proj.{s}"] = torch.cat(
                [hf[a + f"q_proj.{s}"].chunk(d)[r], kv(hf[a + f"k_proj.{s}"]), kv(hf[a + f"v_proj.{s}"])]
            )
        out[a + "o_proj.weight"] = hf[a + "o_proj.weight"].chunk(d, dim=1)[r]
        if spec.routed(i):  # vLLM's fused experts: [E, 2I/d, H] and [E, H, I/d]
            e = [f"{p}mlp.experts.{j}." for j in range(spec.num_experts)]
            out[p + "mlp.gate.weight"] = hf[p + "mlp.gate.weight"]
            out[p + "mlp.experts.routed_experts.w13_weight"] = torch.stack(
                [torch.cat([hf[x + "gate_proj.weight"].chunk(d)[r], hf[x + "up_proj.weight"].chunk(d)[r]]) for x in e]
            )
            out[p + "mlp.experts.routed_experts.w2_weight"] = torch.stack(
                [hf[x + "down_proj.weight"].chunk(d, dim=1)[r] for x in e]
            )
        else:
            out[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [hf[p + "mlp.gate_proj.weight"].chunk(d)[r], hf[p + "mlp.up_proj.weight"].chunk(d)[r]]
            )
            out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(d, dim=1)[r]
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = hf[p + n]
        if spec.qk_norm:  # Qwen3: whole on every rank
            for n in ("q_norm.weight", "k_norm.weight"):
                out[a + n] = hf[a + n]
    return out


def _sync(src_layout, dst_side, src_tensors, **kwargs):
    p = plan(src_layout, dst_side)
    rank = dist.get_rank()
    dst = {name: torch.full(shape, float("nan")) for name, shape in p.dst_shapes.get(rank, {}).items()}
    stats = execute(p, src_tensors, dst, **kwargs)
    return dst, stats


def run_reshard_cases(models: dict[str, tuple[str, list[tuple[int, int, int]]]], dst_tps: list[int]) -> dict:
    """For each model name -> (HF dir, Megatron (tp, pp, dp) layouts): sync into vLLM TP in ``dst_tps`` and HF full.

    Then, on the last case, a sync with a piece corrupted in transit and a sync with a small bucket (memory bound).
    """
    results, last = {}, None
    for model, (hf_dir, layouts) in models.items():
        model_results, last = _model_cases(hf_dir, layouts, dst_tps)
        results.update({(model, *k): v for k, v in model_results.items()})
    return _after_cases(results, **last)


def _model_cases(hf_dir: str, layouts: list[tuple[int, int, int]], dst_tps: list[int]) -> dict:
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    weights = HFWeights(hf_dir)
    hf = {n: weights.get(n) for n in weights.names}
    results = {}
    for tp, pp, dp in layouts:
        layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
        init_distributed(layout)
        world, rank = dist.get_world_size(), dist.get_rank()
        chunk = build_model_chunk(spec, layout, init_weights=False)
        load_hf_into_chunk(chunk, hf_dir, spec, layout, rank, progress=False)
        src_tensors = {n: p.detach() for n, p in chunk.named_parameters()}
        src_layout = megatron_layout(spec, layout, GPUS_PER_NODE)
        for d in dst_tps + ["hf"]:
            if d == "hf":
                dst_side, want = hf_layout(spec, list(range(world)), GPUS_PER_NODE), hf
            else:
                if d > world or spec.num_heads % d:
                    continue
                dst_side, want = vllm_layout(spec, d, world, GPUS_PER_NODE), expected_vllm(hf, spec, rank % d, d)
            dst, stats = _sync(src_layout, dst_side, src_tensors, bucket_bytes=256 * 1024)
            mismatched = sorted(n for n in want if n not in dst or not torch.equal(dst[n].view(want[n].shape), want[n]))
            extra = sorted(set(dst) - set(want))
            everyone = [None] * world
            dist.all_gather_object(everyone, (mismatched, extra))
            results[(tp, pp, dp), d] = {"mismatched": everyone, "buckets": stats.buckets}
    last = dict(spec=spec, src_layout=src_layout, src_tensors=src_tensors, world=world, hf=hf)
    return results, last


def _after_cases(results, spec, src_layout, src_tensors, world, hf):
    # corruption in transit, and the memory bound, on the last layout
    def corrupt(t, piece):
        if t.hf.endswith("mlp.up_proj.weight") and t.dst_rank == 0:
            piece[0] += 1.0

    try:
        _sync(src_layout, vllm_layout(spec, 2, world, GPUS_PER_NODE), src_tensors, on_send=corrupt)
        results["corrupt"] = None
    except ReshardVerificationError as e:
        results["corrupt"] = str(e)
    _sync(src_layout, vllm_layout(spec, 2, world, GPUS_PER_NODE), src_tensors, compare_full=True)  # clean: passes
    try:
        _sync(src_layout, vllm_layout(spec, 2, world, GPUS_PER_NODE), src_tensors, on_send=corrupt, verify=False,
              compare_full=True)  # fmt: skip
        results["corrupt_full"] = None
    except ReshardVerificationError as e:
        results["corrupt_full"] = str(e)
    bucket = 16 * 1024
    _, stats = _sync(src_layout, vllm_layout(spec, 2, world, GPUS_PER_NODE), src_tensors, bucket_bytes=bucket)
    model_bytes = sum(t.numel() * 4 for t in hf.values())
    peaks = [None] * world
    dist.all_gather_object(peaks, stats.peak_buffer_bytes)
    results["memory"] = {
        "bucket": bucket,
        "model_bytes": model_bytes,
        "peak_buffer_bytes": peaks,
        "buckets": stats.buckets,
    }
    return results
