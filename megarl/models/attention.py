"""Core attention for the local (torch) layer spec on ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materialises the [b, heads, s, s] score matrix and runs an unfused softmax:
on an H100 that is the whole gap between megarl's local-spec step and a plain transformers step
(``../shared/facts/gpu-h100-first-contact.md``). ``SdpaAttention`` computes the same function with torch's fused
kernels (flash / memory-efficient on CUDA, the flash kernel on CPU), which never hold the scores: it saves q, k, v,
the output and one log-sum-exp per query and head.

It takes ``DotProductAttention``'s place in the layer spec (``megarl.models.builder.layer_spec``), with its
constructor, forward signature and softmax scale (1/sqrt(head_dim) unless the config gives ``softmax_scale``). The
mask is Megatron's: causal from the spec, or an explicit boolean ``attention_mask`` where True means "masked out".
megarl's micro-batches are right-padded and pass no mask, so causal attention is exact for every real token.
Grouped-query attention shares each K/V head with its query group without copying it where the kernel allows
(``_native_gqa``: on CPU, and on CUDA in bf16/fp16); in fp32 on CUDA K/V are repeated to the query heads first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

ATTENTION = ("sdpa", "unfused")
"""``model.attention`` choices for ``transformer_impl: local``: ``sdpa`` (this module) or Megatron's ``unfused``."""


class SdpaAttention(DotProductAttention):
    """Megatron core attention on torch's scaled-dot-product attention. Inputs [s, b, heads, head_dim] as
    ``DotProductAttention``'s; output [s, b, heads x head_dim]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        refused = {
            "attention_dropout": (self.attention_dropout.p, 0.0),
            "window_size": (config.window_size, None),
            "softmax_type": (config.softmax_type, "vanilla"),
        }
        for name, (value, supported) in refused.items():
            if value != supported:
                raise ValueError(f"model.attention=sdpa does not support {name}={value!r}; use model.attention=unfused")
        # DotProductAttention divides its scale by the layer number under query-key layer scaling and multiplies the
        # scores back inside its softmax: the function is softmax(q k^T * scale * coeff)
        self.scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("model.attention=sdpa takes no packed sequences or attention bias")
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and attention_mask is None
        if causal and query.shape[0] != key.shape[0]:
            raise ValueError(f"causal attention needs as many queries as keys, got {query.shape[0]} and {key.shape[0]}")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        gqa = k.shape[1] != q.shape[1]
        if gqa and not _native_gqa(q, attention_mask):  # repeat K/V rather than fall back to the math backend
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
            gqa = False
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if attention_mask is None else ~attention_mask,  # Megatron: True = masked out
            is_causal=causal,
            scale=self.scale,
            enable_gqa=gqa,  # K/V heads shared by their query group, not repeated
        )
        s, b = query.shape[:2]
        return context.permute(2, 0, 1, 3).reshape(s, b, -1)  # [b, n, s, d] -> [s, b, n*d]


def _native_gqa(query: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a fused kernel takes fewer K/V heads than query heads here. The CPU's flash kernel does; on CUDA only
    flash does (fp16/bf16, no mask): in fp32 or with a mask torch would pick its math backend, which holds the
    scores, so K/V are repeated first and the memory-efficient kernel runs."""
    return not query.is_cuda or (query.dtype in (torch.float16, torch.bfloat16) and mask is None)
