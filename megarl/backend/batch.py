"""Training sequences -> Megatron micro-batches, packed by a token budget and right-padded to their own longest.

A training sequence is the exact token ids the engine saw and produced (prompt + response, never re-tokenised).
Inputs are ``tokens[:-1]`` and targets ``tokens[1:]``, so the output at position ``i`` scores token ``i + 1`` and the
response's ``j``-th token is scored at position ``prompt_len - 1 + j``. Padding is on the right, so causal attention
is exact for the real tokens; padded positions carry mask 0.

Per-token fields (advantages, old log-probs, ...) are response-aligned 1-D tensors (one value per response token);
``collate`` places them at their positions in the micro-batch and ``response_values`` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sequence:
    """One training sequence: prompt + response token ids and where the response starts."""

    tokens: list[int]
    prompt_len: int

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def pack_micro_batches(lengths: list[int], *, max_tokens: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of sequence indices.

    ``max_tokens > 0``: a group grows while (sequences x its longest sequence) stays within ``max_tokens`` padded
    tokens (a longer sequence gets a group of its own). ``max_tokens == 0``: groups of ``micro_batch_size``."""
    if max_tokens <= 0:
        return [
            list(range(i, min(i + micro_batch_size, len(lengths)))) for i in range(0, len(lengths), micro_batch_size)
        ]
    groups, current, longest = [], [], 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def collate(seqs: list[Sequence], fields: dict[str, list[torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """One micro-batch: ``tokens``, ``targets``, ``position_ids``, ``loss_mask`` [b, S] (S = longest - 1), plus each
    response-aligned field scattered to [b, S] (0 outside the response), and ``scored_from``: the first position
    that scores a response token (the shortest prompt's length - 1; nothing before it needs logits)."""
    fields = fields or {}
    width = max(len(s.tokens) for s in seqs) - 1
    b = len(seqs)
    tokens = torch.zeros(b, width, dtype=torch.long)
    targets = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.float32)
    out = {name: torch.zeros(b, width, dtype=torch.float32) for name in fields}
    for i, s in enumerate(seqs):
        ids = torch.tensor(s.tokens, dtype=torch.long)
        n = len(s.tokens) - 1
        tokens[i, :n], targets[i, :n] = ids[:-1], ids[1:]
        start = s.prompt_len - 1
        mask[i, start:n] = 1.0
        for name, values in fields.items():
            out[name][i, start:n] = values[i]
    positions = torch.arange(width).expand(b, width).contiguous()
    first = min(max(min(s.prompt_len for s in seqs) - 1, 0), width - 1)  # one position even if no response
    return {"tokens": tokens, "targets": targets, "position_ids": positions, "loss_mask": mask, **out,
            "scored_from": first}  # fmt: skip


def response_values(values_BS: torch.Tensor, seqs: list[Sequence]) -> list[torch.Tensor]:
    """Inverse of ``collate`` for one per-position tensor: each sequence's response-aligned values."""
    return [values_BS[i, s.prompt_len - 1 : len(s.tokens) - 1].clone() for i, s in enumerate(seqs)]


def micro_batches(
    seqs: list[Sequence],
    fields: dict[str, list[torch.Tensor]] | None = None,
    *,
    max_tokens: int,
    micro_batch_size: int,
) -> tuple[list[dict], list[list[int]]]:
    """Pack ``seqs`` (with their response-aligned ``fields``) into collated micro-batches; also returns the groups
    of indices, to map per-micro-batch outputs back to sequences."""
    fields = fields or {}
    groups = pack_micro_batches(
        [len(s.tokens) - 1 for s in seqs], max_tokens=max_tokens, micro_batch_size=micro_batch_size
    )
    batches = [
        collate([seqs[i] for i in g], {name: [values[i] for i in g] for name, values in fields.items()}) for g in groups
    ]
    return batches, groups
