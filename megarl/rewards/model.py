"""A reward model: a Megatron GPT model with a scalar score head, converted from an HF ``*ForSequenceClassification``
checkpoint with one label, scoring whole sequences (prompt + response) the way HF's head does."""

from __future__ import annotations

import torch

from megarl.backend.batch import Batching, PackStats, Sequence
from megarl.backend.losses import critic_values
from megarl.backend.update import forward_fields


def score_position(token_ids: list[int], pad_token_id: int | None) -> int:
    """Where HF's sequence-classification head reads a sequence's score: the rightmost token that is not
    ``pad_token_id`` (so with pad = eos, the token before a final EOS); the last token when there is no pad id; 0 when
    every token is pad (transformers' argmax rule)."""
    if pad_token_id is None:
        return len(token_ids) - 1
    return max((i for i, t in enumerate(token_ids) if t != pad_token_id), default=0)


def scored_sequence(token_ids: list[int], pad_token_id: int | None) -> Sequence:
    """The sequence a forward reads the score of: the tokens up to the scored position, then one more token. Its one
    response token's aligned output is the head's output at the scored position (causal: the extra token changes
    nothing before it)."""
    pos = score_position(token_ids, pad_token_id)
    return Sequence(list(token_ids[: pos + 1]) + [token_ids[pos]], pos + 1)


def reward_model_scores(model, sequences: list[list[int]], pad_token_id: int | None, batching: Batching,
                        stats: PackStats | None = None) -> list[float]:  # fmt: skip
    """Collective over the model's ranks: one score per sequence (prompt + response token ids), in fp32."""
    seqs = [scored_sequence(s, pad_token_id) for s in sequences]
    with torch.no_grad():
        values = forward_fields(model, seqs, critic_values, batching, stats)
    return [float(v[0]) for v in values]
