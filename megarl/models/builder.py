"""Build this rank's Megatron GPTModel chunk for a ModelSpec (actor, reference, or critic with a value head).

The builder only reads the already-initialised Megatron parallel state (which stage this rank is); the degrees come
from the layout. No rank arithmetic happens here.

Placement and dtype follow Megatron's ``get_model`` + ``Float16Module``: the built chunk lives on one device (the
rank's GPU for training; the CPU for conversion and export, which must never need a GPU as large as the model), and
every parameter and floating buffer is in ``model.dtype``, norms and heads included (the optimizer keeps fp32 main
parameters). Megatron's own fp32 tensors held as plain attributes (RoPE's ``inv_freq``) keep their dtype.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megarl.compat import cpu as cpu_compat
from megarl.compat.compiled import check_compile_elementwise
from megarl.compat.cpu import megatron_mode
from megarl.compat.megatron_fixes import (
    experts_in_their_own_buffer,
    restore_tp_attributes,
    router_without_transformer_engine,
)
from megarl.compat.megatron_speed import (
    batch_major_logits,
    compiled_rope_as_megatrons_fusion,
    linear_without_communication,
    no_tp_mappings_on_one_rank,
    rms_norm_on_cpu,
    rope_in_four_ops,
)
from megarl.models.family import MOE_TP_REFUSAL, UnsupportedModelError
from megarl.models.spec import DTYPE_BYTES, ModelSpec
from megarl.models.swiglu import CompiledSwiGLU, SwiGLU
from megarl.models.value_head import ValueHead
from megarl.parallel.layout import ParallelLayout

DTYPES = {name: getattr(torch, name) for name in DTYPE_BYTES}


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_config(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    dtype: str = "float32",
    transformer_impl: str = "local",
    init_weights: bool = True,
    recompute: bool = False,
    cpu_init: bool = False,
    compile_elementwise: bool = False,
    routing_replay: bool = False,
):
    """Megatron TransformerConfig for ``spec`` at ``layout``: GQA, SwiGLU, RMSNorm, no dropout, fusions off.

    ``init_weights=False`` skips random initialisation (the weights are about to be loaded). ``recompute``: full
    activation recompute of every layer in the backward pass. ``cpu_init``: Megatron creates the weights on the CPU
    (else on ``torch.cuda.current_device()``). ``compile_elementwise``: Megatron's RoPE fusion on, which runs
    megarl's compiled RoPE (``megarl.compat.megatron_speed.compiled_rope_as_megatrons_fusion``).
    ``routing_replay``: each router gets Megatron's ``RouterReplay`` (``megarl.backend.moe.RoutingReplay`` drives it).
    """
    from megatron.core.transformer import TransformerConfig

    params_dtype = DTYPES[dtype]
    return TransformerConfig(
        **_architecture(spec),
        cuda_graph_scope=[],  # the whole layer; megatron-core 0.16.1's default "full" warns that it is deprecated
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=compile_elementwise and compiled_rope_as_megatrons_fusion(),
        # the local spec's MLP takes its activation module from the spec (megarl.models.swiglu); the flag is
        # Megatron's name for "the spec gives the activation", no Transformer Engine involved
        use_te_activation_func=transformer_impl == "local",
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        # experts' weights are marked allreduce=False by it, which puts them in DDP's expert buffers (reduced over
        # the expert-DP group); left at 1 under EP, DDP averages different experts' gradients over the DP group
        expert_model_parallel_size=layout.ep,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        # micro-batches are padded to their own longest sequence: stages exchange each activation's shape first
        variable_seq_lengths=layout.pp > 1,
        moe_token_dispatcher_type="alltoall",  # the default (allgather) refuses variable lengths (PP > 1)
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=cpu_init,
        transformer_impl=transformer_impl,
        perform_initialization=init_weights,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}),
        **({"moe_enable_routing_replay": True} if routing_replay else {}),
    )


def _architecture(spec: ModelSpec) -> dict:
    """The TransformerConfig fields that describe the model itself (what the HF config says), not how it runs."""
    return dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        **_experts(spec),
    )


def _experts(spec: ModelSpec) -> dict:
    """The MoE fields of TransformerConfig (none for a dense model). The router runs in fp32 whatever the dtype;
    HF's ``norm_topk_prob`` (renormalise the top-k probabilities) is a softmax over the top-k logits, Megatron's
    ``moe_router_pre_softmax=False`` (moe_utils.py); Megatron's own load-balancing loss stays off: megarl's
    ``megarl.backend.moe`` computes it at any coefficient (to log it) and attaches it."""
    if not spec.is_moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_top_k,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_layer_freq=list(spec.moe_layers),  # a list: an integer N means "every layer i with i % N == 0"
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_aux_loss_coeff=0.0,
    )


def block_spec(config, spec: ModelSpec, transformer_impl: str, attention: str = "sdpa", compiled: bool = False):
    """The decoder's spec: one layer spec for a dense model; for an MoE model this stage's layers, each dense or
    routed-expert as ``spec.moe_layers`` says (Megatron's ``get_gpt_decoder_block_spec`` with the local spec's
    modules of ``layer_spec``)."""
    dense = layer_spec(transformer_impl, attention, compiled, qk_layernorm=spec.qk_norm)
    if not spec.is_moe:
        return dense
    from megatron.core.transformer import transformer_block as block
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    moe = layer_spec(transformer_impl, attention, compiled, qk_layernorm=spec.qk_norm, num_experts=spec.num_experts)
    layers = [moe if sparse else dense for sparse in spec.moe_layers]
    offset = get_transformer_layer_offset(config)
    return block.TransformerBlockSubmodules(  # the final norm a dense model's block gets (transformer_block.py)
        layer_specs=layers[offset : offset + block.get_num_layers_to_build(config)], layer_norm=block.LayerNormImpl
    )


def layer_spec(
    transformer_impl: str,
    attention: str = "sdpa",
    compiled: bool = False,
    *,
    qk_layernorm: bool = False,
    num_experts: int | None = None,
):
    """Megatron layer spec: the local (torch) spec, or Transformer Engine's when requested and importable.

    The local spec's MLP activation is ``megarl.models.swiglu.SwiGLU``; its core attention is ``attention``:
    ``sdpa`` (``megarl.models.attention.SdpaAttention``, torch's fused kernels) or ``unfused`` (Megatron's
    ``DotProductAttention``, which materialises the scores). ``compiled``: the activation is ``CompiledSwiGLU``
    (torch.compile's kernels). TE's spec has its own fused attention and activation. ``qk_layernorm``: per-head
    RMSNorm on queries and keys (Qwen3; ``self_attention.{q,k}_layernorm``). ``num_experts``: a routed-expert MLP
    (``mlp.router``, ``mlp.experts.local_experts.{j}``, Megatron's ``SequentialMLP``) whose experts are SwiGLU too
    (the local MoE spec leaves their activation unset, so ``activation_func`` would apply to [gate; up])."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megarl.models.attention import ATTENTION, SdpaAttention  # with Megatron's layer specs: when a model is built

    if attention not in ATTENTION:
        raise ValueError(f"model.attention must be one of {ATTENTION}, got {attention!r}")

    if transformer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise RuntimeError(
                "transformer_impl=transformer_engine but transformer_engine is not installed "
                "(GPU only: pip install -e .[gpu]); use model.transformer_impl=local"
            )
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=qk_layernorm
    )
    mlp = spec.submodules.mlp.submodules
    (mlp.experts.submodules if num_experts else mlp).activation_func = CompiledSwiGLU if compiled else SwiGLU
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec


def build_model_chunk(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    value_head: bool = False,
    dtype: str = "float32",
    transformer_impl: str = "local",
    init_weights: bool = True,
    recompute: bool = False,
    device: torch.device | str | None = None,
    attention: str = "sdpa",
    compile_elementwise: bool = False,
    routing_replay: bool = False,
):
    """This rank's GPTModel chunk (its pipeline stage and TP shard), every tensor on ``device`` (default: the
    rank's, ``rank_device()``; conversion passes ``"cpu"``) and every parameter in ``dtype``. ``value_head=True``
    builds a critic; a ``spec.score_head`` (a reward model) gets the same scalar head without bias. ``attention``:
    the local spec's core attention (``layer_spec``). ``compile_elementwise``: the SwiGLU, the CPU RMSNorm
    and the RoPE run torch.compile's kernels (``megarl.compat.compiled``; CPU and the local spec only).
    ``routing_replay``: the routers can replay given experts (``transformer_config``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if spec.is_moe and layout.tp > 1:
        raise UnsupportedModelError(f"{spec.family} at tp={layout.tp}: {MOE_TP_REFUSAL}")
    if refusal := spec.ep_refusal(layout.ep):
        raise UnsupportedModelError(f"{spec.family} at ep={layout.ep}: {refusal}")
    device = torch.device(device) if device is not None else rank_device()
    if compile_elementwise:
        check_compile_elementwise(device.type, transformer_impl)
    config = transformer_config(
        spec, layout, dtype=dtype, transformer_impl=transformer_impl, init_weights=init_weights, recompute=recompute,
        cpu_init=device.type == "cpu", compile_elementwise=compile_elementwise, routing_replay=routing_replay,
    )  # fmt: skip
    rope_in_four_ops()
    router_without_transformer_engine()
    no_tp_mappings_on_one_rank()
    linear_without_communication()
    with megatron_mode():
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(config, spec, transformer_impl, attention, compile_elementwise),
            vocab_size=spec.padded_vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=spec.tie_word_embeddings and not (value_head or spec.score_head),
            position_embedding_type="rope",
            rotary_base=spec.rope_theta,
            rope_scaling=spec.rope_scaling_factor is not None,
            rope_scaling_factor=spec.rope_scaling_factor or 8.0,
        )
        if (value_head or spec.score_head) and model.post_process:
            model.output_layer = ValueHead(spec.hidden_size, dtype=config.params_dtype, bias=not spec.score_head)
    batch_major_logits(model)
    rms_norm_on_cpu(model, compile_elementwise)
    restore_tp_attributes(model)
    experts_in_their_own_buffer(model)
    place(model, device, config.params_dtype)
    return model


def place(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Move every parameter and buffer of ``model`` to ``device`` and every floating one to ``dtype``, in place;
    tensors held as plain module attributes (RoPE's ``inv_freq``) move to ``device`` in their own dtype.

    Parameters are re-created with their attributes (Megatron's TP flags): ``Module.to`` would lose them on a
    device whose tensors cannot share a CPU tensor's storage type (the placement guard's ``meta``). Call it before
    wrapping (DDP, the optimizer hold the parameter objects)."""
    moved: dict[int, tuple] = {}  # id -> (original, placed): shared parameters (tied weights) stay shared

    def to(t: torch.Tensor, cast: bool = True) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if cast and t.is_floating_point() else t.dtype)

    def placed(p: torch.nn.Parameter) -> torch.nn.Parameter:
        if to(p.data) is p.data:  # already there, in its dtype
            return p
        q = torch.nn.Parameter(to(p.data), requires_grad=p.requires_grad)
        q.__dict__.update(p.__dict__)
        return q

    with torch.no_grad():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    if id(p) not in moved:
                        moved[id(p)] = (p, placed(p))
                    module._parameters[name] = moved[id(p)][1]
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = to(b)
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                    setattr(module, name, to(value, cast=False))


def rank_device() -> torch.device:
    """Where this rank's models live: its GPU (``torch.cuda.set_device`` at process-group start) on CUDA; without
    CUDA the CPU shim's device (the CPU, or the placement guard's fake device)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return cpu_compat.device()
