"""Runs inside every spawned rank: the same full weights and batch through several Megatron layouts.

For each case it reports the loss of one training step and the full (TP/PP-merged) weights after one SGD step.
The reference case is the single-rank computation: TP=PP=1, and every DP replica sees the whole batch, so the DP
mean of identical gradients is exactly the single-rank gradient.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megarl.backend.setup import wrap_for_training
from megarl.backend.step import lm_loss, make_lm_micro_batches, train_step
from megarl.config.schema import OptimConfig
from megarl.models.builder import build_model_chunk
from megarl.models.spec import ModelSpec
from megarl.parallel import megatron_shards as shards
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout

LR = 0.5


def tiny_spec(tied: bool = False, qwen3: bool = False, moe: bool = False) -> ModelSpec:
    """Llama-style with a QKV bias (Qwen2's layout); ``qwen3``: per-head q/k norms, no bias, head_dim 64 (4 x 64 !=
    hidden 128); ``moe``: Qwen3-MoE, both layers routed over 4 SwiGLU experts of width 64, top-2, renormalised."""
    if moe:
        return dataclasses.replace(tiny_spec(tied, qwen3=True), family="qwen3_moe", moe_layers=(1, 1), num_experts=4,
                                   moe_top_k=2, moe_ffn_hidden_size=64, moe_norm_topk_prob=True)  # fmt: skip
    if qwen3:
        return dataclasses.replace(tiny_spec(tied), family="qwen3", qkv_bias=False, qk_norm=True, head_dim=64)
    return ModelSpec(
        family="llama",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_size=256,
        vocab_size=320,
        padded_vocab_size=384,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_scaling_factor=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        qkv_bias=True,
    )


def value_loss(micro_batch, values_BS1):
    err = values_BS1.squeeze(-1) - micro_batch["targets"]
    loss = (err * err).mean()
    return loss, {"loss": loss.detach().clone()}  # clone: the schedule divides `loss` in place


def _full_weights(spec: ModelSpec, value_head: bool) -> dict[str, torch.Tensor]:
    """Seeded random full weights with the shapes of a TP=1, PP=1 model (built on a 1-stage view of this spec)."""
    gen = torch.Generator().manual_seed(7)
    names_shapes = _full_shapes(spec, value_head)
    return {
        n: (1.0 + 0.1 * torch.randn(s, generator=gen)) if "norm" in n else 0.05 * torch.randn(s, generator=gen)
        for n, s in names_shapes.items()
    }


def _full_shapes(spec: ModelSpec, value_head: bool) -> dict[str, tuple]:
    h, d = spec.hidden_size, spec.head_dim
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * d
    out = {"embedding.word_embeddings.weight": (spec.padded_vocab_size, h)}
    for i in range(spec.num_layers):
        p, f = f"decoder.layers.{i}.", spec.ffn_hidden_size
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attention.linear_qkv.weight"] = (qkv, h)
        if spec.qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = (qkv,)
        if spec.qk_norm:
            out[p + "self_attention.q_layernorm.weight"] = out[p + "self_attention.k_layernorm.weight"] = (d,)
        out[p + "self_attention.linear_proj.weight"] = (h, spec.num_heads * d)
        out[p + "pre_mlp_layernorm.weight"] = (h,)
        mlps = [p + "mlp."]
        if spec.routed(i):
            out[p + "mlp.router.weight"], f = (spec.num_experts, h), spec.moe_ffn_hidden_size
            mlps = [f"{p}mlp.experts.local_experts.{j}." for j in range(spec.num_experts)]
        for m in mlps:
            out[m + "linear_fc1.weight"], out[m + "linear_fc2.weight"] = (2 * f, h), (h, f)
    out["decoder.final_layernorm.weight"] = (h,)
    if value_head:
        out["output_layer.weight"], out["output_layer.bias"] = (1, h), (1,)
    elif not spec.tie_word_embeddings:
        out["output_layer.weight"] = (spec.padded_vocab_size, h)
    return out


def _batch(spec: ModelSpec, n: int = 4, t: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {
        "tokens": torch.randint(0, spec.vocab_size, (n, t + 1), generator=gen),
        "targets": torch.randn(n, t, generator=gen),
    }


def _gather_full(model_chunk, layout: ParallelLayout, spec: ModelSpec, value_head: bool) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    c = layout.coords(rank)
    local = {k: v.detach().clone() for k, v in model_chunk.state_dict().items()
             if not k.endswith("_extra_state") and ".lora." not in k}  # fmt: skip (LoRA factors: gather_adapters)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ((c.tp, c.pp, c.dp), local))
    by_coord = {(t, p, d): sd for (t, p, d), sd in everyone if d < layout.ep}  # one replica: DP ranks 0..ep-1
    return shards.full_state_dict(by_coord, layout.tp, layout.pp, spec.num_layers, ep=layout.ep,
                                  num_experts=spec.num_experts, tied_embeddings=spec.tie_word_embeddings,
                                  value_head=value_head)  # fmt: skip


def run_case(
    layout: ParallelLayout,
    spec: ModelSpec,
    *,
    value_head=False,
    distributed_optimizer=False,
    adam=False,
    reference=False,
):
    """One training step at ``layout``; ``adam`` swaps SGD for Adam (Megatron's distributed optimizer needs Adam)."""
    init_distributed(layout, seed=1)
    rank = dist.get_rank()
    c = layout.coords(rank)
    chunk = build_model_chunk(spec, layout, value_head=value_head)
    full = _full_weights(spec, value_head)
    local = shards.local_state_dict(
        full,
        shards.StageInfo.at(layout, rank, spec),
        c.tp,
        layout.tp,
        tied_embeddings=spec.tie_word_embeddings,
        value_head=value_head,
    )
    missing, unexpected = chunk.load_state_dict(local, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    # Adam's first step is ~lr*sign(g); a large eps keeps it smooth in g, so layouts can be compared elementwise.
    optim = (
        OptimConfig(
            optimizer="adam", lr=1e-2, adam_eps=1e-3, clip_grad=0.0, use_distributed_optimizer=distributed_optimizer
        )
        if adam
        else OptimConfig(optimizer="sgd", lr=LR, clip_grad=0.0)
    )
    model, optimizer = wrap_for_training(chunk, optim)
    batch = _batch(spec)
    if reference:
        tokens, targets = batch["tokens"], batch["targets"]
    else:  # this DP rank's contiguous slice of the global batch
        per_dp = batch["tokens"].shape[0] // layout.dp
        tokens = batch["tokens"][c.dp * per_dp : (c.dp + 1) * per_dp]
        targets = batch["targets"][c.dp * per_dp : (c.dp + 1) * per_dp]
    micro_batches = make_lm_micro_batches(tokens, micro_batch_size=1)
    for i, mb in enumerate(micro_batches):
        mb["targets"] = targets[i : i + 1]
        if value_head:
            del mb["labels"]
    metrics = train_step(model, optimizer, micro_batches, value_loss if value_head else lm_loss)
    updated = _gather_full(chunk, layout, spec, value_head)
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    result = {
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "weights": updated,
        "initial": full,
        "optimizer": type(inner).__name__,
    }
    if value_head:
        result["values_shape"] = _values_shape(model, micro_batches[0])
    return result


def _values_shape(model, micro_batch) -> list[int] | None:
    """Shape of the critic's output for one micro-batch (on the last stage; shared with every rank)."""
    from megarl.backend.step import forward_backward

    def record(mb, values):
        dims = {f"dim{i}": torch.tensor(float(n)) for i, n in enumerate(values.shape)}
        return values.sum() * 0, dims

    metrics = forward_backward(model, [micro_batch], record, forward_only=True)
    return [int(metrics[k]) for k in sorted(metrics)]


def run_cases(cases: list[tuple[str, dict]]) -> dict:
    """Run each named case (kwargs of run_case) in order on this process group; rank 0 returns all results."""
    return {name: run_case(**kwargs) for name, kwargs in cases}
