"""Critic value head: hidden state -> one scalar per token."""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    """Replaces GPTModel's output layer for a critic; returns values of shape [s, b, 1] like logits [s, b, vocab].

    Its input is the final-norm hidden state, which is full on every TP rank, so the head is replicated and needs no
    communication. It keeps the output layer's call signature so GPTModel's post-processing is reused unchanged.
    """

    sequence_parallel = False  # read by GPTModel._postprocess

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32, bias: bool = True):
        """``bias=False``: a reward model's score head (HF's ``score`` linear has none)."""
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None

    def forward(self, hidden_states_SBH, weight=None, runtime_gather_output=None):
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.linear(hidden_states_SBH.float(), self.weight.float(), bias), None
