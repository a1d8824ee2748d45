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
