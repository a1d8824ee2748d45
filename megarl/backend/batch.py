"""Training sequences -> Megatron micro-batches: a mini-batch's sequences shared out over the data-parallel ranks by
tokens, each rank's packed by length under a token budget and right-padded to their own longest.

A training sequence is the exact token ids the engine saw and produced (prompt + response, never re-tokenised).
Inputs are ``tokens[:-1]`` and targets ``tokens[1:]``, so the output at position ``i`` scores token ``i + 1`` and the
response's ``j``-th token is scored at position ``prompt_len - 1 + j``. Padding is on the right, so causal attention
is exact for the real tokens; padded positions carry mask 0.

Per-token fields (advantages, old log-probs, ...) are response-aligned 1-D tensors (one value per response token);
``collate`` places them at their positions in the micro-batch and ``response_values`` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.parallel.layout import prompt_slice


@dataclass(frozen=True)
class Sequence:
    """One training sequence: prompt + response token ids and where the response starts."""

    tokens: list[int]
    prompt_len: int
    mask: tuple[int, ...] | None = None
    """Per response token, 1 if it is in the loss (the model's), 0 if not (an episode's observation); None: all."""
    routes: torch.Tensor | None = field(default=None, compare=False)
    """The engine's experts per input position (``Sample.routed_experts``: [len(tokens) - 1, MoE layers, k]), for
    rollout routing replay; None: not recorded."""

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def loss_tokens(self) -> int:
        """Response tokens in the loss."""
        return self.response_len if self.mask is None else sum(self.mask)


@dataclass(frozen=True)
class Batching:
    """How a role cuts the step's sequences: mini-batches of ``global_batch_size`` sequences, micro-batches of
    ``max_tokens`` padded tokens (0: ``micro_batch_size`` sequences), cut by ``packing`` (``actor.packing``:
    ``sorted`` or ``consecutive``, see ``plan``)."""

    global_batch_size: int
    max_tokens: int
    micro_batch_size: int
    packing: str = "sorted"


def pack_micro_batches(lengths: list[int], *, max_tokens: int, micro_batch_size: int, packing: str = "sorted"
                       ) -> list[list[int]]:  # fmt: skip
    """Groups of sequence indices, one per micro-batch.

    ``max_tokens > 0``: no group's padded size (sequences x its longest sequence) exceeds ``max_tokens`` unless it is
    one sequence longer than the budget. ``max_tokens <= 0``: groups of ``micro_batch_size``.
    ``packing="sorted"``: the sequences longest first (ties in batch order), cut where padding plus a fixed cost per
    group is least (``_tightest_cut``), so each group holds sequences of similar length. ``"consecutive"``: in batch
    order, each group grown while it fits."""
    order = list(range(len(lengths)))
    if packing == "sorted":
        order.sort(key=lambda i: -lengths[i])
    if max_tokens <= 0:
        return [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    if packing == "sorted":
        cuts = _tightest_cut([lengths[i] for i in order], max_tokens)
        return [order[a:b] for a, b in zip(cuts, cuts[1:])]
    groups, current, longest = [], [], 0
    for i in order:
        n = lengths[i]
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


MICRO_BATCH_COST = 1 / 16
"""What one more micro-batch costs in ``_tightest_cut``, as a fraction of a full micro-batch's padded positions: its
fixed cost, mostly the host issuing its kernels. A judgement between two measured ends: the 1.2B model's profiled step
on an H200 (docs/training.md, "Measured": 0.618 s of host time issuing 0.471 s of kernels for 8 micro-batches of
2 x 2,048 tokens) pays more for a micro-batch's launches than for its compute; a 70B model computes ~80x more per
token for about the same launches. A split is taken when it saves more padding than a sixteenth of the budget."""


def _tightest_cut(descending: list[int], budget: int) -> list[int]:
    """Where to cut lengths sorted longest first into groups of padded size ``(b - a) x descending[a] <= budget``
    (or one sequence): the fewest padded positions plus ``MICRO_BATCH_COST x budget`` per group. Dynamic programming
    over the cut points (a group starting at ``a`` holds at most ``budget // descending[a]`` sequences); returns
    ``[0, ..., n]``."""
    n, per_group = len(descending), MICRO_BATCH_COST * budget
    best: list[float | None] = [None] * (n + 1)  # the cost of the first j sequences
    best[0], back = 0.0, [0] * (n + 1)
    for a in range(n):
        longest = descending[a]
        for b in range(a + 1, min(n, a + max(1, budget // max(longest, 1))) + 1):
            cost = best[a] + (b - a) * longest + per_group
            if best[b] is None or cost < best[b]:
                best[b], back[b] = cost, a
    cuts = [n]
    while cuts[-1]:
        cuts.append(back[cuts[-1]])
    return cuts[::-1]


def share_out(lengths: list[int], ranks: int, packing: str = "sorted") -> list[list[int]]:
    """Each data-parallel rank's indices (in batch order) of one mini-batch's sequences. ``sorted``: longest first,
    each to the rank with the fewest tokens so far (then the smallest sum of squared lengths, attention's cost; then
    the lowest rank), so any two ranks' tokens differ by at most the longest sequence, and with at least ``ranks``
    sequences (of positive length, as training sequences are) every rank gets one. A pure function of the lengths:
    every rank computes the same shares, no collective. ``consecutive``: contiguous slices whose sizes differ by at
    most one."""
    if packing == "consecutive":
        return [list(prompt_slice(len(lengths), r, ranks)) for r in range(ranks)]
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [(0, 0, r) for r in range(ranks)]  # (tokens, sum of squares, rank)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        tokens, squares, r = min(load)
        shares[r].append(i)
        load[r] = (tokens + lengths[i], squares + lengths[i] ** 2, r)
    return [sorted(s) for s in shares]


FILLER = Sequence([0, 0], 2)
"""What a rank runs to keep pace with ranks that have more micro-batches (``plan``'s ``lockstep``): one position, no
response token, so it weighs nothing in any masked loss; collated (``filler_batch``) its position is padding, which
the load-balancing loss leaves out."""


def plan(lengths: list[int], ranks: int, batching: Batching, *, lockstep: bool = False) -> list[list[list[int]]]:
    """One mini-batch on ``ranks`` data-parallel ranks: each rank's micro-batches as groups of indices into
    ``lengths`` (positions: tokens - 1; ``share_out``, then ``pack_micro_batches``). ``lockstep``: every rank gets as
    many micro-batches as the rank with the most, the others topped up with empty groups (``FILLER``s), for layouts
    whose ranks must run the same number of passes (an expert-parallel group's all-to-alls)."""
    out = []
    for share in share_out(lengths, ranks, batching.packing):
        groups = pack_micro_batches([lengths[i] for i in share], max_tokens=batching.max_tokens,
                                    micro_batch_size=batching.micro_batch_size, packing=batching.packing)  # fmt: skip
        out.append([[share[j] for j in g] for g in groups])
    if lockstep:
        most = max(len(groups) for groups in out)
        out = [groups + [[] for _ in range(most - len(groups))] for groups in out]
    return out


@dataclass
class PackStats:
    """What a role's passes computed, over all its data-parallel ranks: positions in micro-batches (padding
    included), positions of real tokens, micro-batches."""

    computed: int = 0
    real: int = 0
    micro_batches: int = 0

    def count(self, groups: list[list[int]], positions) -> None:
        """Add a pass over micro-batches ``groups`` of sequences of ``positions[i]`` positions each (tokens - 1; an
        empty group is a ``FILLER``)."""
        for g in groups:
            width = max((positions[i] for i in g), default=len(FILLER.tokens) - 1)
            self.computed += max(len(g), 1) * width
            self.real += sum(positions[i] for i in g)
            self.micro_batches += 1

    def add(self, other: PackStats) -> None:
        self.computed += other.computed
        self.real += other.real
        self.micro_batches += other.micro_batches

    def take(self) -> PackStats:
        """These counts; zero them."""
        out = PackStats(self.computed, self.real, self.micro_batches)
        self.computed = self.real = self.micro_batches = 0
        return out

    @property
    def padding_frac(self) -> float:
        return 1.0 - self.real / self.computed if self.computed else 0.0


def collate(seqs: list[Sequence], fields: dict[str, list[torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """One micro-batch: ``tokens``, ``targets``, ``position_ids``, ``loss_mask`` [b, S] (S = longest - 1),
    ``padding_mask`` [b, S] (True past a sequence's end: routed-expert layers leave those out of their
    load-balancing loss), plus each response-aligned field scattered to [b, S] (0 outside the response), and
    ``scored_from``: the first position that scores a response token (the shortest prompt's length - 1; nothing
    before it needs logits). Sequences with ``routes``: ``routes`` [b, S, MoE layers, k], padding positions routed to
    experts 0..k-1."""
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
        mask[i, start:n] = 1.0 if s.mask is None else torch.tensor(s.mask, dtype=torch.float32)
        for name, values in fields.items():
            out[name][i, start:n] = values[i]
    positions = torch.arange(width).expand(b, width).contiguous()
    padding = positions >= torch.tensor([len(s.tokens) - 1 for s in seqs]).unsqueeze(1)
    first = min(max(min(s.prompt_len for s in seqs) - 1, 0), width - 1)  # one position even if no response
    if any(s.routes is not None for s in seqs):
        out["routes"] = _collated_routes(seqs, width)
    return {"tokens": tokens, "targets": targets, "position_ids": positions, "loss_mask": mask,
            "padding_mask": padding, **out, "scored_from": first}  # fmt: skip


def _collated_routes(seqs: list[Sequence], width: int) -> torch.Tensor:
    """The sequences' routes as [b, width, MoE layers, k]: row ``i`` for input position ``i``, padding routed to
    experts 0..k-1 (any valid experts: nothing reads a padding position's output)."""
    shape = next(s.routes.shape for s in seqs if s.routes is not None)[1:]
    if any(s.routes is None for s in seqs):
        raise ValueError("a micro-batch mixes sequences with and without the engine's routes")
    out = torch.arange(shape[1], dtype=seqs[0].routes.dtype).expand(len(seqs), width, *shape).clone()
    for i, s in enumerate(seqs):
        if s.routes.shape != (len(s.tokens) - 1, *shape):
            raise ValueError(f"routes of {tuple(s.routes.shape)} for a sequence of {len(s.tokens)} tokens")
        out[i, : len(s.tokens) - 1] = s.routes
    return out


def response_values(values_BS: torch.Tensor, seqs: list[Sequence]) -> list[torch.Tensor]:
    """Inverse of ``collate`` for one per-position tensor: each sequence's response-aligned values."""
    return [values_BS[i, s.prompt_len - 1 : len(s.tokens) - 1].clone() for i, s in enumerate(seqs)]


def micro_batches(
    seqs: list[Sequence], groups: list[list[int]], fields: dict[str, list[torch.Tensor]] | None = None
) -> list[dict]:
    """``groups`` (indices into ``seqs``, as ``plan`` gives them) of ``seqs`` with their response-aligned ``fields``,
    collated; an empty group is a ``FILLER``."""
    fields = fields or {}
    return [collate([seqs[i] for i in g], {name: [values[i] for i in g] for name, values in fields.items()})
            if g else filler_batch(fields) for g in groups]  # fmt: skip


def filler_batch(fields: dict[str, list[torch.Tensor]]) -> dict:
    """A ``FILLER`` collated: no response token, and its one position marked padding, so a routed-expert layer's
    load-balancing loss leaves it out too."""
    batch = collate([FILLER], {name: [values[0][:0]] for name, values in fields.items()})
    batch["padding_mask"][:] = True
    return batch
