"""Model families, each described once: what megarl accepts from a HF config and how it differs from Llama.

Families are looked up through the ``FAMILIES`` registry by HF ``model_type``; there is no if/elif on names.
"""

from __future__ import annotations

from dataclasses import dataclass

# Megatron-core 0.16.1's llama3 RoPE scaling hard-codes these (rotary_pos_embedding.py, _apply_scaling).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


MOE_TP_REFUSAL = ("an MoE model trains at tp=1 (megatron-core's MoE layers need sequence parallelism at TP > 1, "
                  "which megarl lacks); use tp=1 and scale with dp or pp")


class UnsupportedModelError(ValueError):
    """The HF config describes an architecture or option megarl cannot represent exactly."""


@dataclass(frozen=True)
class ModelFamily:
    """One decoder family: Llama-style blocks (RMSNorm, SwiGLU, RoPE, GQA) plus the family's differences."""

    name: str
    """Registry key."""
    hf_model_type: str
    """``model_type`` in the HF config."""
    hf_architecture: str
    """HF class written to ``architectures`` on export."""
    qkv_bias: bool
    """Q/K/V projections have a bias (Qwen2)."""
    honours_config_head_dim: bool
    """Whether the family reads ``head_dim`` from the config (vLLM's Qwen2 ignores it: hidden / heads is used)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys after the projection, before RoPE (Qwen3's ``self_attn.{q,k}_norm``)."""
    default_head_dim: int | None = None
    """``head_dim`` when the config omits it (Qwen3's config class defaults to 128); None: hidden / heads."""
    moe: bool = False
    """Routed-expert MLPs (Qwen3-MoE): a softmax top-k router (``mlp.gate``) over ``num_experts`` SwiGLU experts of
    ``moe_intermediate_size``, no shared expert; layers listed in ``mlp_only_layers`` (or off the
    ``decoder_sparse_step``) keep a dense MLP of ``intermediate_size``."""

    def moe_layers(self, hf: dict) -> tuple[int, ...]:
        """Per layer 1 where HF builds a routed-expert MLP, 0 for a dense one (``modeling_qwen3_moe.py``: layer i
        is sparse iff i is not in ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0); () when the
        family has no experts."""
        if not self.moe:
            return ()
        dense, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step", 1)
        return tuple(int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"]))

    def head_dim(self, hf: dict) -> int:
        derived = hf["hidden_size"] // hf["num_attention_heads"]
        given = hf.get("head_dim", self.default_head_dim)
        if given is None or given == derived:
            return derived
        if not self.honours_config_head_dim:
            raise UnsupportedModelError(
                f"{self.name}: head_dim={given} differs from hidden_size/num_attention_heads={derived}, "
                f"which {self.name} implementations ignore; set hidden_size = heads x head_dim"
            )
        return given

    def rope_scaling_factor(self, hf: dict) -> float | None:
        rs = hf.get("rope_scaling") or {}
        params = hf.get("rope_parameters") or {}
        rope_type = rs.get("rope_type") or rs.get("type") or params.get("rope_type") or "default"
        if rope_type == "default":
            return None
        if rope_type == "llama3":
            source = {**params, **rs}
            for key, want in _MEGATRON_LLAMA3_ROPE.items():
                if float(source.get(key, want)) != want:
                    raise UnsupportedModelError(
                        f"llama3 rope scaling with {key}={source.get(key)} is not supported "
                        f"(megatron-core 0.16.1 fixes {key}={want})"
                    )
            return float(source["factor"])
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported (supported: plain RoPE and 'llama3')"
        )

    def check_supported(self, hf: dict) -> None:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{self.name}: hidden_act={act!r} is not supported (only SwiGLU/silu)")
        if hf.get("attention_bias", False) and not self.qkv_bias:
            raise UnsupportedModelError(f"{self.name}: attention_bias=true is not supported")
        if hf.get("mlp_bias", False):
            raise UnsupportedModelError(f"{self.name}: mlp_bias=true is not supported")
        window = hf.get("sliding_window")
        if window is not None and hf.get("use_sliding_window", True) and window < hf.get("max_position_embeddings", 0):
            raise UnsupportedModelError(
                f"{self.name}: sliding_window={window} is not supported; set sliding_window to null "
                f"(or >= max_position_embeddings) to train with full attention"
            )
        shared = hf.get("shared_expert_intermediate_size") or hf.get("n_shared_experts") or 0
        if self.moe and shared:
            raise UnsupportedModelError(f"{self.name}: shared experts are not supported (shared_expert_* is set)")
        if "sliding_attention" in (hf.get("layer_types") or ()):
            raise UnsupportedModelError(f"{self.name}: sliding-window layers (layer_types) are not supported")
        self.rope_scaling_factor(hf)


FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily("llama", "llama", "LlamaForCausalLM", qkv_bias=False, honours_config_head_dim=True),
    "qwen2": ModelFamily("qwen2", "qwen2", "Qwen2ForCausalLM", qkv_bias=True, honours_config_head_dim=False),
    "mistral": ModelFamily("mistral", "mistral", "MistralForCausalLM", qkv_bias=False, honours_config_head_dim=True),
    "qwen3": ModelFamily("qwen3", "qwen3", "Qwen3ForCausalLM", qkv_bias=False, honours_config_head_dim=True,
                         qk_norm=True, default_head_dim=128),
    "qwen3_moe": ModelFamily("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", qkv_bias=False,
                             honours_config_head_dim=True, qk_norm=True, default_head_dim=128, moe=True),
}
_BY_MODEL_TYPE = {f.hf_model_type: f for f in FAMILIES.values()}


def family_for_hf_config(hf: dict) -> ModelFamily:
    model_type = hf.get("model_type")
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported; supported: {sorted(_BY_MODEL_TYPE)}"
        ) from None
