"""Build this rank's Megatron GPTModel chunk for a ModelSpec (actor, reference, or critic with a value head).

The builder only reads the already-initialised Megatron parallel state (which stage this rank is); the degrees come
from the layout. No rank arithmetic happens here.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megarl.compat import megatron_mode
from megarl.compat.megatron_fixes import restore_tp_attributes
from megarl.models.spec import ModelSpec
from megarl.models.value_head import ValueHead
from megarl.parallel.layout import ParallelLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
):
    """Megatron TransformerConfig for ``spec`` at ``layout``: GQA, SwiGLU, RMSNorm, no dropout, fusions off.

    ``init_weights=False`` skips random initialisation (the weights are about to be loaded). ``recompute``: full
    activation recompute of every layer in the backward pass.
    """
    from megatron.core.transformer import TransformerConfig

    params_dtype = DTYPES[dtype]
    return TransformerConfig(
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
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        # micro-batches are padded to their own longest sequence: stages exchange each activation's shape first
        variable_seq_lengths=layout.pp > 1,
        moe_token_dispatcher_type="alltoall",  # no MoE here; the default (allgather) refuses variable lengths
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        transformer_impl=transformer_impl,
        perform_initialization=init_weights,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}),
    )


def layer_spec(transformer_impl: str):
    """Megatron layer spec: the local (torch) spec, or Transformer Engine's when requested and importable."""
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise RuntimeError(
                "transformer_impl=transformer_engine but transformer_engine is not installed "
                "(GPU only: pip install -e .[gpu]); use model.transformer_impl=local"
            )
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def build_model_chunk(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    value_head: bool = False,
    dtype: str = "float32",
    transformer_impl: str = "local",
    init_weights: bool = True,
    recompute: bool = False,
):
    """This rank's GPTModel chunk (its pipeline stage and TP shard). ``value_head=True`` builds a critic; a
    ``spec.score_head`` (a reward model) gets the same scalar head without bias."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(
        spec, layout, dtype=dtype, transformer_impl=transformer_impl, init_weights=init_weights, recompute=recompute
    )
    with megatron_mode():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(transformer_impl),
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
    restore_tp_attributes(model)
    return model
