"""The SwiGLU of the local (torch) layer spec as one autograd function: ``silu(gate) * up`` of fc1's fused output.

Megatron's local MLP computes it from autograd's pieces: ``chunk``, ``silu(gate) * (up + glu_linear_offset)``. That
adds an offset of 0 (a copy of ``up``), keeps ``silu(gate)`` and that copy for backward beside fc1's output (which
``gate`` and ``up`` are views of), and joins the two halves' gradients with a ``cat``. ``swiglu`` keeps only fc1's
output, recomputes ``silu(gate)`` in backward and writes both halves' gradients into one tensor: the same values
(the same elementwise operations in the same order; only the sign of a zero can differ, as ``up + 0`` turns -0.0
into +0.0), 2 x ffn_hidden elements fewer saved per token and layer, and two copies fewer per layer. Megatron takes
it through its layer spec (``MLPSubmodules.activation_func``, used when ``TransformerConfig.use_te_activation_func``
is set; the name is Megatron's, no Transformer Engine is involved): ``megarl.models.builder``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fused: torch.Tensor) -> torch.Tensor:
        gate, up = fused.chunk(2, dim=-1)
        ctx.save_for_backward(fused)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (fused,) = ctx.saved_tensors
        gate, up = fused.chunk(2, dim=-1)
        grad_fused = torch.empty_like(fused)
        grad_gate, grad_up = grad_fused.chunk(2, dim=-1)
        torch.mul(grad, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_fused


def swiglu(fused: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``fused`` is [..., 2f] = [gate | up] (fc1's output on this TP rank)."""
    return _SwiGLU.apply(fused)


class SwiGLU(torch.nn.Module):
    """Megatron MLP activation module (``MLPSubmodules.activation_func``): [..., 2f] -> [..., f]."""

    def __init__(self, config=None):
        super().__init__()
        if config is not None and (config.glu_linear_offset != 0.0 or config.activation_func_clamp_value is not None):
            raise ValueError("megarl's SwiGLU takes no glu_linear_offset or activation clamp")

    def forward(self, fused: torch.Tensor) -> torch.Tensor:
        return swiglu(fused)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Nothing to checkpoint (Megatron's MLP asks each of its modules for its sharded state)."""
        return {}
