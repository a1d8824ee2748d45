"""A CPU stand-in for Transformer Engine's layer spec, and the case that runs a TE-named model through megarl.

TE cannot be installed on these machines. Its layer spec differs from the local one in what matters to megarl's
weight handling: ``linear_qkv`` and ``linear_fc1`` are ``TELayerNormColumnParallelLinear``, a norm fused into the
linear (the layer's ``input_layernorm`` / ``pre_mlp_layernorm`` are identities), so the norms' weights are named
``self_attention.linear_qkv.layer_norm_weight`` / ``mlp.linear_fc1.layer_norm_weight`` and the linear's input is the
un-normalised residual stream. ``to_te_layers`` turns a built local-spec chunk into that: the same parameters under
TE's names, the same forward, and the return convention of TE's ``LayerNormLinear`` under Megatron's wrapper
(``return_layernorm_output``: ``((out, normed), None)``; megatron/core/extensions/transformer_engine.py and
transformer_engine/pytorch/module/layernorm_linear.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp


class LayerNormColumnLinear(ColumnParallelLinear):
    """Stand-in for ``TELayerNormColumnParallelLinear`` (RMSNorm, no bias returned separately)."""

    return_layernorm_output = False
    return_layernorm_output_gathered = False

    def forward(self, x, *args, **kwargs):
        normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.config.layernorm_epsilon)
        out, bias = ColumnParallelLinear.forward(self, normed, *args, **kwargs)
        return ((out, normed), bias) if self.return_layernorm_output else (out, bias)


def to_te_layers(chunk) -> None:
    """Fuse every layer's two norms into the linear after them, as TE's layer spec builds the layer."""
    for layer in chunk.decoder.layers:
        for norm_attr, linear in (("input_layernorm", layer.self_attention.linear_qkv),
                                  ("pre_mlp_layernorm", layer.mlp.linear_fc1)):  # fmt: skip
            norm = getattr(layer, norm_attr)
            linear.__class__ = LayerNormColumnLinear
            linear.register_parameter("layer_norm_weight", norm.weight)
            setattr(layer, norm_attr, IdentityOp())


def te_case(hf_dir: str, adapter_dir: str, tp: int) -> dict:
    """On each rank: a local-spec chunk and a TE-named one, both loaded from ``hf_dir``; then both with the PEFT
    adapter of ``adapter_dir``. Returns names, the TE chunk's logits (base, adapted, and a local chunk holding its
    merged weights) and whether its tensors and gradients equal the local chunk's."""
    from megarl.config.schema import LoraConfig
    from megarl.convert.hf_to_megatron import load_hf_into_chunk
    from megarl.convert.verify import megatron_logits, verification_tokens
    from megarl.lora import apply_lora, read_peft_adapter
    from megarl.lora.adapters import local_factors
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.builder import build_model_chunk
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.reshard.layout import megatron_layout
    from megarl.reshard.sync import actor_tensors

    layout = ParallelLayout(tp=tp)
    init_distributed(layout, seed=7)
    rank = dist.get_rank()
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    tokens = verification_tokens(spec.vocab_size, batch=2, seq=16, seed=7)

    def build(te: bool):
        chunk = build_model_chunk(spec, layout, init_weights=False)
        if te:
            to_te_layers(chunk)
        load_hf_into_chunk(chunk, hf_dir, spec, layout, rank, progress=False)
        return chunk

    local, te = build(False), build(True)
    out = {"names": sorted(n for n, _ in te.named_parameters())}
    source = {s.name for s in megatron_layout(spec, layout, tp).ranks[rank]}
    te_tensors, local_tensors = actor_tensors(te), actor_tensors(local)
    out["sync_names_match_layout"] = set(te_tensors) == source
    out["sync_tensors_equal"] = set(te_tensors) == set(local_tensors) and all(
        torch.equal(te_tensors[n], local_tensors[n]) for n in local_tensors
    )
    out["base"] = megatron_logits(te, tokens, spec.vocab_size)
    out["base_local"] = megatron_logits(local, tokens, spec.vocab_size)

    lora = LoraConfig(rank=4, alpha=8, init_from=adapter_dir)
    full = read_peft_adapter(adapter_dir, lora, spec)
    for chunk in (local, te):
        apply_lora(chunk, spec, lora, layout.coords(rank).tp, tp, full=full, seed=0)
    out["tokens"] = tokens
    out["adapted"] = megatron_logits(te, tokens, spec.vocab_size)
    from megarl.lora import adapters_off

    with adapters_off(te):  # the reference policy with LoRA: TE's extra output still taken off
        out["adapters_off"] = megatron_logits(te, tokens, spec.vocab_size)
    merged = build_model_chunk(spec, layout, init_weights=False)  # W + s B A of the TE chunk, in a plain chunk
    with torch.no_grad():
        params = dict(merged.named_parameters())
        for name, value in actor_tensors(te).items():
            params[name].copy_(value)
    out["merged"] = megatron_logits(merged, tokens, spec.vocab_size)

    grads = {}
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    for key, chunk in (("local", local), ("te", te)):  # the adapters' gradients flow through TE's normed output
        chunk.zero_grad()
        from megarl.compat.cpu import megatron_mode

        with megatron_mode():
            chunk(tokens, position_ids, None).float().pow(2).mean().backward()
        grads[key] = {k: f.grad.clone() for k, f in _factors(chunk).items()}
    out["factor_grads_equal"] = grads["te"].keys() == grads["local"].keys() and all(
        torch.allclose(grads["te"][k], grads["local"][k], rtol=1e-5, atol=1e-7) for k in grads["local"]
    )
    out["factor_grads_nonzero"] = all(g.abs().sum() > 0 for g in grads["te"].values())
    out["factors_equal"] = all(torch.equal(a, b) for a, b in zip(local_factors(local).values(),
                                                                  local_factors(te).values()))  # fmt: skip
    return out


def _factors(chunk) -> dict[str, torch.Tensor]:
    return {n: p for n, p in chunk.named_parameters() if ".lora." in n}


class _GroupedLinear(torch.nn.Module):
    """TE's grouped linear as named: expert j's weight is ``weight{j}`` (the same Parameter objects)."""

    def __init__(self, weights: list[torch.nn.Parameter]):
        super().__init__()
        for j, w in enumerate(weights):
            self.register_parameter(f"weight{j}", w)


class GroupedExperts(torch.nn.Module):
    """Stand-in for ``TEGroupedMLP``'s names and shapes: a layer's experts as ``linear_fc1.weight{j}`` [2I, H] and
    ``linear_fc2.weight{j}`` [H, I], over the same parameters as the ``SequentialMLP`` it replaces, whose forward it
    runs (held outside the module tree, so each parameter has one name)."""

    def __init__(self, sequential):
        super().__init__()
        experts = sequential.local_experts
        self.linear_fc1 = _GroupedLinear([e.linear_fc1.weight for e in experts])
        self.linear_fc2 = _GroupedLinear([e.linear_fc2.weight for e in experts])
        self.__dict__["sequential"] = sequential

    def forward(self, *args, **kwargs):
        return self.sequential(*args, **kwargs)


def to_te_grouped_experts(chunk) -> int:
    """Every routed layer's ``mlp.experts`` as ``GroupedExperts``; returns how many."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    layers = [layer for layer in chunk.decoder.layers if isinstance(getattr(layer.mlp, "experts", None), SequentialMLP)]
    for layer in layers:
        layer.mlp.experts = GroupedExperts(layer.mlp.experts)
    return len(layers)


def te_grouped_experts_case(hf_dir: str) -> dict:
    """At EP=2 (DP=2): a local-spec Qwen3-MoE chunk and one whose experts carry TE's grouped names, both loaded from
    ``hf_dir``: their names, whether the weight sync's tensors are the reshard layout's sources and equal the local
    chunk's, both chunks' logits, and the HF tensors exported from the grouped chunk's (every rank's experts)."""
    from megarl.convert.hf_to_megatron import load_hf_into_chunk
    from megarl.convert.verify import megatron_logits, verification_tokens
    from megarl.models import read_hf_config, spec_from_hf_config
    from megarl.models.adapter import tensor_maps, to_hf
    from megarl.models.builder import build_model_chunk
    from megarl.parallel import megatron_shards as ms
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.reshard.layout import megatron_layout
    from megarl.reshard.sync import actor_tensors

    layout = ParallelLayout(dp=2, ep=2)
    init_distributed(layout, seed=7)
    rank = dist.get_rank()
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    local = build_model_chunk(spec, layout, init_weights=False)
    grouped = build_model_chunk(spec, layout, init_weights=False)
    out = {"grouped_layers": to_te_grouped_experts(grouped)}
    for chunk in (local, grouped):
        load_hf_into_chunk(chunk, hf_dir, spec, layout, rank, progress=False)
    out["names"] = sorted(n for n, _ in grouped.named_parameters())
    source = {s.name for s in megatron_layout(spec, layout, 2).ranks[rank]}
    tensors, local_tensors = actor_tensors(grouped), actor_tensors(local)
    out["sync_names_match_layout"] = set(tensors) == source
    out["sync_tensors_equal"] = set(tensors) == set(local_tensors) and all(
        torch.equal(tensors[n], local_tensors[n]) for n in local_tensors)  # fmt: skip
    tokens = verification_tokens(spec.vocab_size, batch=2, seq=16, seed=7)
    out["logits"], out["logits_local"] = megatron_logits(grouped, tokens, spec.vocab_size), megatron_logits(
        local, tokens, spec.vocab_size)
    stage = ms.StageInfo.at(layout, rank, spec)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {ms.global_name(n, stage): t for n, t in tensors.items()})
    full = {k: v for part in everyone for k, v in part.items()}
    out["exported"] = {hf: t for m in tensor_maps(spec) for hf, t in zip(m.hf, to_hf(m, full[m.megatron], spec))}
    return out
