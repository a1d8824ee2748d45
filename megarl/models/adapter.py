"""HF <-> Megatron tensor mapping for the Llama-style families (Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE), described
once.

Each Megatron full tensor (TP=1 names, global layer index) is built from one or more HF tensors:

| Megatron (decoder.layers.i. ...)   | HF (model.layers.i. ...)                 | layout                               |
|------------------------------------|------------------------------------------|--------------------------------------|
| embedding.word_embeddings.weight   | model.embed_tokens.weight                | rows padded to the padded vocabulary |
| input_layernorm.weight             | input_layernorm.weight                   | copy                                 |
| self_attention.linear_qkv.{w,b}    | self_attn.{q,k,v}_proj.{w,b} (b: Qwen2)  | per query group g: [q_g; k_g; v_g]   |
| self_attention.{q,k}_layernorm.w   | self_attn.{q,k}_norm.weight (Qwen3)      | copy ([head_dim], per-head RMSNorm)  |
| self_attention.linear_proj.weight  | self_attn.o_proj.weight                  | copy                                 |
| pre_mlp_layernorm.weight           | post_attention_layernorm.weight          | copy                                 |
| mlp.linear_fc1.weight              | mlp.gate_proj.weight, mlp.up_proj.weight | [gate; up]                           |
| mlp.linear_fc2.weight              | mlp.down_proj.weight                     | copy                                 |
| mlp.router.weight (MoE layer)      | mlp.gate.weight [experts, hidden]        | copy                                 |
| mlp.experts.local_experts.j.fc1/2  | mlp.experts.j.{gate,up,down}_proj.weight | as linear_fc1 / linear_fc2           |
| decoder.final_layernorm.weight     | model.norm.weight                        | copy                                 |
| output_layer.weight (untied only)  | lm_head.weight                           | rows padded                          |

The resharding engine uses the same table to name and lay out destination tensors.

Names are the local spec's. Transformer Engine's layer spec fuses each norm into the linear after it, so a TE model
names the two norms ``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``:
``local_spec_name`` maps them back, from Megatron's own map (the local spec's ``sharded_state_dict_keys_map``, by
which a local-spec model writes TE's names into a distributed checkpoint, so both load the same checkpoint).
TE's grouped-GEMM experts (``TEGroupedMLP``) hold a layer's experts in one linear per projection, expert j's weight
as ``mlp.experts.linear_fc1.weight{j}`` / ``linear_fc2.weight{j}``: ``local_spec_name`` maps them to
``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`` (both write the same distributed-checkpoint keys).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from megarl.models.spec import ModelSpec

COPY, QKV, GATE_UP, VOCAB = "copy", "qkv", "gate_up", "vocab"


@dataclass(frozen=True)
class TensorMap:
    """One Megatron full tensor and the HF tensors it is made of."""

    megatron: str
    """Megatron name (TP=1, global layer index)."""
    hf: tuple[str, ...]
    """HF names, in the order the layout concatenates them."""
    kind: str
    """How they combine: copy, qkv (grouped per query group), gate_up ([gate; up]) or vocab (rows padded)."""
    layer: int | None = None
    """Global layer index, None for embedding / final norm / output layer."""


@functools.cache
def fused_norm_prefixes() -> dict[str, str]:
    """Local-spec prefix -> Transformer Engine prefix of the norms TE fuses into a linear, within a layer
    (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``, ``pre_mlp_layernorm.`` ->
    ``mlp.linear_fc1.layer_norm_``), as megatron-core's local layer spec declares them (a constant of the installed
    megatron-core)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map)


_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)linear_fc([12])\.weight(\d+)$")


def local_spec_name(name: str) -> str:
    """A model parameter's name under the local spec, whichever spec built the model: TE's fused norm names
    (``decoder.layers.3.self_attention.linear_qkv.layer_norm_weight``) become the norms' own
    (``decoder.layers.3.input_layernorm.weight``), TE's grouped experts (``mlp.experts.linear_fc1.weight5``) the
    local ones (``mlp.experts.local_experts.5.linear_fc1.weight``); every other name is the same in both."""
    grouped = _GROUPED_EXPERT.match(name)
    if grouped:
        head, fc, j = grouped.groups()
        return f"{head}local_experts.{j}.linear_fc{fc}.weight"
    for local, te in fused_norm_prefixes().items():
        head, sep, tail = name.partition("." + te)
        if sep and tail in ("weight", "bias"):
            return f"{head}.{local}{tail}"
    return name


def local_spec_names(named) -> dict:
    """``{local_spec_name(name): value}`` of ``(name, value)`` pairs (e.g. ``chunk.named_parameters()``)."""
    return {local_spec_name(name): value for name, value in named}


def tensor_maps(spec: ModelSpec) -> list[TensorMap]:
    """Every Megatron tensor of ``spec`` in model order (embedding, layers 0..L-1, final norm, output layer)."""
    maps = [TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB)]
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = h + "self_attn."
        maps += [
            TensorMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), COPY, i),
            TensorMap(m + "self_attention.linear_qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"), QKV, i),
        ]
        if spec.qkv_bias:
            maps.append(
                TensorMap(m + "self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), QKV, i)
            )
        if spec.qk_norm:
            maps += [TensorMap(f"{m}self_attention.{p}_layernorm.weight", (f"{attn}{p}_norm.weight",), COPY, i)
                     for p in "qk"]  # fmt: skip
        maps += [
            TensorMap(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), COPY, i),
            TensorMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), COPY, i),
        ]
        maps += _experts(m, h, i, spec) if spec.routed(i) else _swiglu(m + "mlp.", h + "mlp.", i)
    maps.append(TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), COPY))
    if spec.score_head:  # a reward model: HF's [1, hidden] score head
        maps.append(TensorMap("output_layer.weight", ("score.weight",), COPY))
    elif not spec.tie_word_embeddings:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), VOCAB))
    return maps


def _swiglu(m: str, h: str, i: int) -> list[TensorMap]:
    """One SwiGLU MLP: Megatron ``{m}linear_fc{1,2}`` from HF ``{h}{gate,up,down}_proj``."""
    return [
        TensorMap(m + "linear_fc1.weight", (h + "gate_proj.weight", h + "up_proj.weight"), GATE_UP, i),
        TensorMap(m + "linear_fc2.weight", (h + "down_proj.weight",), COPY, i),
    ]


def _experts(m: str, h: str, i: int, spec: ModelSpec) -> list[TensorMap]:
    """A routed-expert MLP (hub layout, which ``save_pretrained`` writes): the router ``mlp.gate`` [E, hidden] and
    each expert j's SwiGLU, ``mlp.experts.j`` <-> ``mlp.experts.local_experts.j``."""
    maps = [TensorMap(m + "mlp.router.weight", (h + "mlp.gate.weight",), COPY, i)]
    for j in range(spec.num_experts):
        maps += _swiglu(f"{m}mlp.experts.local_experts.{j}.", f"{h}mlp.experts.{j}.", i)
    return maps


def to_megatron(tmap: TensorMap, hf_tensors: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """The Megatron full tensor from its HF tensors (new memory; the inputs are not modified)."""
    if tmap.kind == COPY:
        return hf_tensors[0].clone()
    if tmap.kind == VOCAB:
        rows = hf_tensors[0]
        if rows.shape[0] != spec.vocab_size:
            raise ValueError(f"{tmap.hf[0]} has {rows.shape[0]} rows but the config says vocab_size={spec.vocab_size}")
        padded = rows.new_zeros((spec.padded_vocab_size, *rows.shape[1:]))
        padded[: spec.vocab_size] = rows
        return padded
    if tmap.kind == GATE_UP:
        return torch.cat(hf_tensors, dim=0)
    if tmap.kind == QKV:
        q, k, v = hf_tensors
        groups, d = spec.num_kv_heads, spec.head_dim
        tail = q.shape[1:]
        grouped = torch.cat(
            [q.reshape(groups, -1, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)], dim=1
        )
        return grouped.reshape(-1, *tail)
    raise ValueError(f"unknown mapping kind {tmap.kind!r}")


def to_hf(tmap: TensorMap, tensor: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """Inverse of ``to_megatron``: the HF tensors (in ``tmap.hf`` order), contiguous."""
    if tmap.kind == COPY:
        return [tensor.contiguous()]
    if tmap.kind == VOCAB:
        return [tensor[: spec.vocab_size].contiguous()]
    if tmap.kind == GATE_UP:
        return [t.contiguous() for t in tensor.chunk(2, dim=0)]
    if tmap.kind == QKV:
        groups, d = spec.num_kv_heads, spec.head_dim
        q_per_group = spec.num_heads // groups * d
        tail = tensor.shape[1:]
        q, k, v = tensor.reshape(groups, q_per_group + 2 * d, *tail).split([q_per_group, d, d], dim=1)
        return [t.reshape(-1, *tail).contiguous() for t in (q, k, v)]
    raise ValueError(f"unknown mapping kind {tmap.kind!r}")
