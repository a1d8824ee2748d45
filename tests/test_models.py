"""Model families: HF config -> ModelSpec -> TransformerConfig, and refusal of what megarl cannot represent."""

import pytest
import torch

from megarl.models import UnsupportedModelError, read_hf_config, spec_from_hf_config
from megarl.models.builder import layer_spec, transformer_config, transformer_engine_available
from megarl.models.family import MOE_TP_REFUSAL
from megarl.parallel.layout import ParallelLayout

BASE = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}


@pytest.mark.parametrize("model_type, qkv_bias", [("llama", False), ("qwen2", True), ("mistral", False)])
def test_families(model_type, qkv_bias):
    spec = spec_from_hf_config({**BASE, "model_type": model_type, "rope_theta": 1e6, "tie_word_embeddings": True})
    assert spec.family == model_type and spec.qkv_bias == qkv_bias
    assert (spec.num_kv_heads, spec.head_dim, spec.padded_vocab_size) == (2, 32, 384)
    assert spec.rope_theta == 1e6 and spec.tie_word_embeddings
    tc = transformer_config(spec, ParallelLayout(tp=2))
    assert tc.num_query_groups == 2 and tc.gated_linear_unit and tc.normalization == "RMSNorm"
    assert tc.add_qkv_bias == qkv_bias and not tc.add_bias_linear
    assert tc.kv_channels == 32 and tc.tensor_model_parallel_size == 2 and tc.layernorm_epsilon == 1e-5


@pytest.mark.parametrize("head_dim, want", [(64, 64), (None, 128)])  # absent: Qwen3Config's default, 128
def test_qwen3_has_per_head_q_k_norms_and_its_config_s_head_dim(head_dim, want):
    hf = {**BASE, "model_type": "qwen3", **({"head_dim": head_dim} if head_dim else {})}
    spec = spec_from_hf_config(hf)
    assert spec.family == "qwen3" and spec.qk_norm and not spec.qkv_bias and spec.head_dim == want
    tc = transformer_config(spec, ParallelLayout(tp=2))
    assert tc.qk_layernorm and tc.kv_channels == want and not tc.add_qkv_bias
    assert not transformer_config(spec_from_hf_config({**BASE, "model_type": "llama"}), ParallelLayout()).qk_layernorm


MOE = {**BASE, "model_type": "qwen3_moe", "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 64, "norm_topk_prob": True}  # fmt: skip


@pytest.mark.parametrize(
    "extra,layers",
    [({}, (1, 1, 1, 1)), ({"mlp_only_layers": [1]}, (1, 0, 1, 1)),
     ({"decoder_sparse_step": 2}, (0, 1, 0, 1)), ({"num_experts": None, "num_local_experts": 8}, (1, 1, 1, 1))],
)  # fmt: skip
def test_qwen3_moe_layers_follow_hf_and_map_to_megatron_s_router(extra, layers):
    hf = {**MOE, "num_hidden_layers": 4, **extra}
    spec = spec_from_hf_config({k: v for k, v in hf.items() if v is not None})
    assert spec.moe_layers == layers and spec.num_experts == 8 and spec.moe_top_k == 2 and spec.qk_norm
    tc = transformer_config(spec, ParallelLayout())
    assert tc.moe_layer_freq == list(layers) and tc.num_moe_experts == 8 and tc.moe_ffn_hidden_size == 64
    assert tc.moe_router_pre_softmax is False and tc.moe_router_dtype == "fp32" and tc.moe_aux_loss_coeff == 0
    unnorm = spec_from_hf_config({**MOE, "norm_topk_prob": False})
    assert transformer_config(unnorm, ParallelLayout()).moe_router_pre_softmax is True


def test_an_moe_model_at_tp2_is_refused_in_one_line():
    from megarl.config.validate import layout_errors
    from megarl.models.builder import build_model_chunk

    spec = spec_from_hf_config(MOE)
    assert layout_errors(spec, 2, 1) == [f"actor.parallel.tp=2: {MOE_TP_REFUSAL}"] and layout_errors(spec, 1, 2) == []
    with pytest.raises(UnsupportedModelError, match="qwen3_moe at tp=2: an MoE model trains at tp=1"):
        build_model_chunk(spec, ParallelLayout(tp=2))


def test_rope_parameters_and_llama3_scaling():
    hf = {
        **BASE,
        "model_type": "llama",
        "rope_parameters": {
            "rope_theta": 5e5,
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    spec = spec_from_hf_config(hf)
    assert spec.rope_theta == 5e5 and spec.rope_scaling_factor == 8.0


def test_vocab_padding_is_tp_independent():
    assert spec_from_hf_config({**BASE, "model_type": "llama", "vocab_size": 32000}).padded_vocab_size == 32000
    assert spec_from_hf_config({**BASE, "model_type": "llama", "vocab_size": 151646}).padded_vocab_size == 151680


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}},
            "low_freq_factor",
        ),
        ({"model_type": "mistral", "sliding_window": 128}, "sliding_window=128 is not supported"),
        ({"model_type": "qwen2", "head_dim": 64}, "head_dim=64 differs"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen3", "attention_bias": True}, "qwen3: attention_bias=true"),
        ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "sliding-window layers"),
        ({**MOE, "shared_expert_intermediate_size": 64}, "qwen3_moe: shared experts are not supported"),
        ({**MOE, "hidden_act": "gelu"}, "qwen3_moe: hidden_act='gelu' is not supported"),
        ({**MOE, "sliding_window": 64, "use_sliding_window": True}, "qwen3_moe: sliding_window=64"),
    ],
)
def test_unsupported_configs_are_refused(extra, message):
    with pytest.raises(UnsupportedModelError, match=message.replace("(", r"\(").replace("[", r"\[")):
        spec_from_hf_config({**BASE, **extra})


def test_tiny_model_dir_round_trips(tiny_llama_dir):
    spec = spec_from_hf_config(read_hf_config(tiny_llama_dir))
    assert spec.family == "llama" and spec.vocab_size == 320


@pytest.mark.skipif(transformer_engine_available(), reason="TE installed")
def test_transformer_engine_requested_without_te():
    with pytest.raises(RuntimeError, match="transformer_engine is not installed"):
        layer_spec("transformer_engine")


@pytest.mark.parametrize("bias", [True, False])
def test_value_and_score_heads_compute_in_fp32_in_a_bf16_model(bias):
    """A bf16 critic's values (and a reward model's scores) come out in fp32, computed from the upcast input and
    weights: the bf16 product would keep ~3 significant digits before GAE."""
    from megarl.models.value_head import ValueHead

    torch.manual_seed(0)
    head = ValueHead(64, dtype=torch.bfloat16, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, 64))
        if bias:
            head.bias.fill_(0.3)
    h = torch.randn(5, 2, 64).to(torch.bfloat16)
    values, _ = head(h)
    assert head.weight.dtype == torch.bfloat16 and values.dtype == torch.float32 and values.shape == (5, 2, 1)
    exact = h.double() @ head.weight.double().t() + (head.bias.double() if bias else 0.0)
    assert (values.double() - exact).abs().max() < 1e-5
    rounded = torch.nn.functional.linear(h, head.weight, head.bias)  # what a bf16 head would give
    assert (rounded.double() - exact).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_megatrons_glu_and_keeps_only_fc1s_output(dtype):
    """``megarl.models.swiglu`` against Megatron's local GLU (``silu(gate) * (up + 0)`` of fc1's [gate | up]):
    equal output and gradient (``torch.equal``: only a zero's sign may differ); autograd keeps fc1's output only
    (Megatron's also keeps silu(gate) and up + 0); the local layer spec uses it, Transformer Engine's does not."""
    import torch.nn.functional as F

    from megarl.models.swiglu import SwiGLU, swiglu

    fused = torch.randn(5, 3, 2 * 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    grad = torch.randn(5, 3, 48, generator=torch.Generator().manual_seed(1)).to(dtype)

    def megatrons(x):
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * (up + 0.0)

    def run(fn):
        x, saved = fused.clone().requires_grad_(), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fn(x)
        out.backward(grad)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        return out.detach(), x.grad, sum(storages.values())

    results = [run(swiglu), run(megatrons)]
    (out, dx, kept), (out_m, dx_m, kept_m) = results
    assert out.dtype == dx.dtype == dtype
    assert torch.equal(out, out_m) and torch.equal(dx, dx_m)
    element = fused.element_size()
    assert kept == fused.numel() * element and kept_m == 2 * fused.numel() * element, (kept, kept_m)
    assert layer_spec("local").submodules.mlp.submodules.activation_func is SwiGLU
    assert SwiGLU().sharded_state_dict("decoder.layers.0.mlp.activation_func.") == {}  # checkpoints hold nothing
    spec = spec_from_hf_config({**BASE, "model_type": "llama"})
    assert transformer_config(spec, ParallelLayout()).use_te_activation_func  # Megatron's "the spec gives it"
    assert not transformer_config(spec, ParallelLayout(), transformer_impl="transformer_engine").use_te_activation_func
