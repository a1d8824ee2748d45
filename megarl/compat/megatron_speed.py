"""Two copies megatron-core's local path makes on every forward and backward, removed, and the logits the loss does
not score skipped; the arithmetic of what is computed is unchanged.

Measured on the CPU benchmark (``benchmarks/train_step.py``, torch.profiler, one step of 8 x 256 tokens of a 34M Llama):
- ``batch_major_logits``: ``GPTModel._postprocess`` returns ``logits.transpose(0, 1).contiguous()``: the [s, b, v]
  logits are copied to [b, s, v] on the forward and their gradient copied back on the backward, twice the size of
  the whole vocabulary per token (54 ms of copies per step there, the largest tensors of the step). The output
  layer here computes the same logits from the [b, s, h] hidden states (a copy of h values per token instead of v)
  and hands them on as a [s, b, v] view of [b, s, v] memory, so the transpose back is a view and ``contiguous`` is a
  no-op. Every logit is the same dot product, bitwise. Megatron's own cross-entropy (``labels=``) gets its logits
  contiguous in [s, b, v] again (its ``view`` needs that layout).
- ``logits_from``: the same layer computes logits only from a given position on. An RL loss scores response tokens
  only, yet the output layer (a fifth of SmolLM2-135M's FLOPs) and the whole-vocabulary log-softmax ran at every
  prompt position too, their gradients zero there. Positions before the first response token of a micro-batch are
  skipped (``benchmarks/train_step.py --model DIR --prompt P``: ``megarl-sdpa`` beside ``megarl-sdpa-all-logits``).
- ``rope_without_empty_cat``: ``_apply_rotary_pos_emb_bshd`` ends with ``torch.cat((t, t_pass))`` where ``t_pass``
  (the dimensions past the rotary ones) is empty for every model megarl supports: a copy of q and of k in each layer,
  and its backward. Skipped when ``t_pass`` is empty (the cat of an empty tensor is that copy, so values are equal).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.compat.megatron_fixes import _applies  # the same megatron-core versions


def batch_major_logits(model) -> bool:
    """Make ``model.output_layer`` (a ``ColumnParallelLinear`` without sequence parallelism) lay its logits out
    batch-major; returns whether it did (a critic's value head, or another version of megatron-core, is left as is).
    The class is swapped, not the module: parameter names, checkpoints and copies of the model are unchanged."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    layer = getattr(model, "output_layer", None)
    if not _applies() or type(layer) is not ColumnParallelLinear or layer.sequence_parallel:
        return False
    layer.__class__ = _BatchMajorOutputLayer
    _contiguous_logits_for_the_lm_loss()
    return True


@contextmanager
def logits_from(model_chunk, position: int) -> Iterator[int]:
    """Within the block, ``model_chunk``'s output layer computes logits only at sequence positions ``>= position``
    (the forward returns [b, S - first, v] logits). Yields ``first``: ``position``, or 0 where the layer cannot
    (no batch-major output layer: another stage of a pipeline, a value head, sequence parallelism). Positions
    before ``first`` must score nothing: their hidden states get no gradient from the output layer."""
    while not hasattr(model_chunk, "output_layer") and hasattr(model_chunk, "module"):
        model_chunk = model_chunk.module  # DDP, Float16Module
    layer = getattr(model_chunk, "output_layer", None)
    if not isinstance(layer, _BatchMajorOutputLayer) or position <= 0:
        yield 0
        return
    layer.first_position = position
    try:
        yield position
    finally:
        layer.first_position = 0


def _contiguous_logits_for_the_lm_loss() -> None:
    """Megatron's own loss (``labels=``) views the [s, b, v] logits as [s x b, v]: it gets them laid out as it made
    them (the copy batch-major logits save the trainer's losses; idempotent)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.compute_language_model_loss
    if getattr(original, "megarl_patched", False):
        return

    def compute_language_model_loss(self, labels, logits):
        return original(self, labels, logits.contiguous())

    compute_language_model_loss.megarl_patched = True
    LanguageModule.compute_language_model_loss = compute_language_model_loss


def _batch_major_output_layer():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class BatchMajorOutputLayer(ColumnParallelLinear):
        """``ColumnParallelLinear`` on [s, b, h] returning its [s, b, v] output as a view of [b, s, v] memory; from
        position ``first_position`` on (``logits_from``)."""

        first_position = 0

        def forward(self, input_, weight=None, runtime_gather_output=None):
            hidden_BSH = input_[self.first_position :].transpose(0, 1).contiguous()
            logits_BSV, bias = super().forward(hidden_BSH, weight=weight, runtime_gather_output=runtime_gather_output)
            return logits_BSV.transpose(0, 1), bias

    return BatchMajorOutputLayer


_BatchMajorOutputLayer = _batch_major_output_layer()


def rope_without_empty_cat() -> bool:
    """Patch megatron-core's unfused RoPE to skip concatenating an empty pass-through part (idempotent); returns
    whether the patch is in place."""
    if not _applies():
        return False
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd
    if getattr(original, "megarl_patched", False):
        return True

    def apply_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if multi_latent_attention or freqs.shape[-1] != t.shape[-1]:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
        sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
        return (t * cos_) + (rope_utils._rotate_half(t, rotary_interleaved) * sin_)

    apply_bshd.megarl_patched, apply_bshd.original = True, original
    rope_utils._apply_rotary_pos_emb_bshd = apply_bshd
    return True
