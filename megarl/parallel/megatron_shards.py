"""How Megatron (local spec) splits each parameter over TP ranks and PP stages.

Full tensors are named as in a TP=1, PP=1 GPTModel with *global* layer indices
(``decoder.layers.{i}.self_attention.linear_qkv.weight``). Per tensor:

| tensor                                   | TP split                                                   |
|------------------------------------------|------------------------------------------------------------|
| embedding.word_embeddings / output_layer | rows (dim 0) of the padded vocabulary                      |
| linear_qkv (weight, bias)                | dim 0; rows are grouped per query group, so ranks get whole groups |
| linear_fc1 (SwiGLU [gate; up]), experts' | rank r holds cat(gate.chunk(tp)[r], up.chunk(tp)[r])       |
| linear_proj, linear_fc2                  | dim 1                                                      |
| norms (q/k_layernorm too), value head,   | replicated                                                 |
| MoE router                               |                                                            |

EP: each stage's routed experts are split evenly over the ``ep`` ranks of an expert-parallel group and renumbered
from 0 on each (``mlp.experts.local_experts.{j}``: EP rank e holds global experts ``[e * E/ep, (e+1) * E/ep)``).

PP: layers are split evenly and renumbered from 0 on each stage; the embedding lives on the first stage, the final
norm and output layer on the last. With tied embeddings and PP > 1 the last stage holds a copy of the embedding as
``output_layer.weight`` (Megatron keeps the two in sync by all-reducing their gradients); with PP = 1 there is no
``output_layer.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

REPLICATED, ROWS, COLS, GATE_UP = "replicated", "rows", "cols", "gate_up"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)\.(.+)$")


@dataclass(frozen=True)
class StageInfo:
    """What one rank's model chunk holds: its pipeline stage's layers and, of their routed experts, its EP rank's."""

    pp_rank: int
    """Stage index."""
    pp: int
    """Number of stages."""
    num_layers: int
    """Total layers of the model."""
    ep_rank: int = 0
    """Position in the expert-parallel group."""
    ep: int = 1
    """Expert-parallel size."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""

    @classmethod
    def at(cls, layout, rank: int, spec) -> StageInfo:
        """What ``rank`` of ``layout`` (a ``ParallelLayout``) holds of the model ``spec`` (a ``ModelSpec``)."""
        return cls(layout.coords(rank).pp, layout.pp, spec.num_layers, layout.ep_rank(rank), layout.ep,
                   spec.num_experts)  # fmt: skip

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.experts_per_rank

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    @property
    def first_layer(self) -> int:
        return self.pp_rank * self.layers_per_stage

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp - 1


def tp_split(name: str, value_head: bool = False) -> str:
    """How the full tensor ``name`` is split over TP ranks."""
    if name.startswith("output_layer.") and value_head:
        return REPLICATED
    if name.startswith(("embedding.word_embeddings.", "output_layer.")):
        return ROWS
    if ".linear_qkv." in name and not name.endswith("layer_norm_weight"):
        return ROWS
    if name.endswith("linear_fc1.weight"):  # the dense MLP's and each expert's
        return GATE_UP
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return COLS
    return REPLICATED


def shard(full: torch.Tensor, split: str, tp_rank: int, tp: int) -> torch.Tensor:
    """The TP rank's shard of a full tensor (a view where possible)."""
    if split == REPLICATED or tp == 1:
        return full
    if split == ROWS:
        return full.chunk(tp, dim=0)[tp_rank]
    if split == COLS:
        return full.chunk(tp, dim=1)[tp_rank]
    if split == GATE_UP:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    raise ValueError(f"unknown split {split!r}")


def merge(shards: list[torch.Tensor], split: str) -> torch.Tensor:
    """Inverse of ``shard``: the full tensor from the shards of TP ranks 0..tp-1."""
    if split == REPLICATED or len(shards) == 1:
        return shards[0]
    if split == ROWS:
        return torch.cat(shards, dim=0)
    if split == COLS:
        return torch.cat(shards, dim=1)
    if split == GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    raise ValueError(f"unknown split {split!r}")


def local_name(name: str, stage: StageInfo) -> str | None:
    """Name of the full tensor ``name`` on ``stage``, or None when that stage does not hold it."""
    m = _LAYER.match(name)
    if m:
        local = int(m.group(1)) - stage.first_layer
        rest = m.group(2)
        e = _EXPERT.match(rest)
        if e:  # a routed expert: this EP rank's, renumbered
            j = int(e.group(2)) - stage.first_expert
            if not 0 <= j < stage.experts_per_rank:
                return None
            rest = f"{e.group(1)}{j}.{e.group(3)}"
        return f"decoder.layers.{local}.{rest}" if 0 <= local < stage.layers_per_stage else None
    if name.startswith("embedding."):
        return name if stage.is_first else None
    return name if stage.is_last else None


def global_name(name: str, stage: StageInfo) -> str:
    """Inverse of ``local_name``."""
    m = _LAYER.match(name)
    if not m:
        return name
    rest, e = m.group(2), _EXPERT.match(m.group(2))
    if e:
        rest = f"{e.group(1)}{int(e.group(2)) + stage.first_expert}.{e.group(3)}"
    return f"decoder.layers.{int(m.group(1)) + stage.first_layer}.{rest}"


def held_names(name: str, stage: StageInfo, *, tied_embeddings: bool = False) -> list[str]:
    """Local names under which ``stage`` holds the full tensor ``name``: none, one, or two for the embedding when
    tied embeddings under PP put a copy on the last stage as ``output_layer.weight``."""
    lname = local_name(name, stage)
    names = [] if lname is None else [lname]
    if tied_embeddings and name == "embedding.word_embeddings.weight" and stage.is_last and stage.pp > 1:
        names.append("output_layer.weight")
    return names


def local_shards(
    name: str,
    full: torch.Tensor,
    stage: StageInfo,
    tp_rank: int,
    tp: int,
    *,
    tied_embeddings: bool = False,
    value_head: bool = False,
) -> list[tuple[str, torch.Tensor]]:
    """The (local name, shard) pairs that (tp_rank, stage) holds of the full tensor ``name`` (often none, at most two:
    the embedding and, with tied embeddings under PP, its copy on the last stage)."""
    split = tp_split(name, value_head)
    return [
        (lname, shard(full, split, tp_rank, tp)) for lname in held_names(name, stage, tied_embeddings=tied_embeddings)
    ]


def local_state_dict(
    full: dict[str, torch.Tensor],
    stage: StageInfo,
    tp_rank: int,
    tp: int,
    *,
    tied_embeddings: bool = False,
    value_head: bool = False,
) -> dict[str, torch.Tensor]:
    """This (tp_rank, stage)'s Megatron state dict from full TP=1 tensors (see the module docstring)."""
    return {
        lname: tensor
        for name, full_tensor in full.items()
        for lname, tensor in local_shards(
            name, full_tensor, stage, tp_rank, tp, tied_embeddings=tied_embeddings, value_head=value_head
        )
    }


def full_state_dict(
    locals_by_coord: dict[tuple[int, int, int], dict[str, torch.Tensor]],
    tp: int,
    pp: int,
    num_layers: int,
    *,
    ep: int = 1,
    num_experts: int = 0,
    tied_embeddings: bool = False,
    value_head: bool = False,
) -> dict[str, torch.Tensor]:
    """Inverse of ``local_state_dict``: full tensors from every (tp_rank, pp_rank, ep_rank)'s local state dict (one
    DP replica of each; the EP ranks of a stage hold its dense tensors alike and its experts in slices).

    The tied copy of the embedding on the last stage is dropped (the embedding itself is kept).
    """
    full = {}
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            stage = StageInfo(pp_rank, pp, num_layers, ep_rank, ep, num_experts)
            for lname in locals_by_coord[(0, pp_rank, ep_rank)].keys():
                gname = global_name(lname, stage)
                if tied_embeddings and gname == "output_layer.weight":  # the last stage's copy of the embedding
                    continue
                split = tp_split(gname, value_head)
                full[gname] = merge([locals_by_coord[(t, pp_rank, ep_rank)][lname] for t in range(tp)], split)
    return full
