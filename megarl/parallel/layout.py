"""ParallelLayout: the one owner of TP/PP/DP/EP degrees and all rank arithmetic.

Rank order is Megatron's default ``"tp-cp-ep-dp-pp"`` (TP innermost, PP outermost; CP = 1):

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so a TP group is a block of ``tp`` consecutive ranks. vLLM's TP groups are also blocks of consecutive ranks, which is
why a rollout TP equal to the actor TP gives identical groups. Context parallelism is not built.

Expert parallelism sits *inside* data parallelism (the world stays tp x pp x dp): the routed experts of a stage are
split over ``ep`` consecutive DP ranks (an EP group, ``dp_rank = ep_rank + ep * expert_dp_rank``), and the ranks
holding the same experts (equal ``ep_rank``: ``dp / ep`` of them) form an expert-data-parallel group, over which
expert gradients are reduced and their optimizer state sharded. Expert TP equals TP (Megatron's default).

A launch's pools (``Pool``: contiguous rank ranges, their roles) are rank arithmetic too; their process groups live
in ``megarl.parallel.pools``. No torch here: the config checks use this module.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the layout."""

    tp: int
    """Tensor-parallel rank (position inside its TP group)."""
    pp: int
    """Pipeline stage."""
    dp: int
    """Data-parallel replica index."""


@dataclass(frozen=True)
class ParallelLayout:
    """TP x PP x DP degrees over ``world_size`` ranks, optionally placed on nodes of ``gpus_per_node`` ranks."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (number of stages)."""
    dp: int = 1
    """Data-parallel size (number of model replicas)."""
    ep: int = 1
    """Expert-parallel size: DP ranks that split each routed-expert layer's experts (divides ``dp``)."""
    gpus_per_node: int | None = None
    """Ranks per node (for rank -> node). None: unknown, node queries are refused."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be a positive int, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(f"ParallelLayout.ep={self.ep} must divide dp={self.dp} (experts split over DP ranks)")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be positive, got {self.gpus_per_node}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    # --- rank <-> coordinates -------------------------------------------------------------------------------
    def coords(self, rank: int) -> RankCoords:
        """Coordinates of a global rank."""
        self._check_rank(rank)
        return RankCoords(tp=rank % self.tp, dp=(rank // self.tp) % self.dp, pp=rank // (self.tp * self.dp))

    def rank(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """Global rank of the given coordinates."""
        if not (0 <= tp < self.tp and 0 <= pp < self.pp and 0 <= dp < self.dp):
            raise ValueError(f"coordinates (tp={tp}, pp={pp}, dp={dp}) outside layout {self}")
        return tp + self.tp * (dp + self.dp * pp)

    # --- groups ---------------------------------------------------------------------------------------------
    def tp_group(self, rank: int) -> list[int]:
        """Ranks of the TP group that holds ``rank`` (same pp and dp), ordered by tp rank."""
        c = self.coords(rank)
        return [self.rank(t, c.pp, c.dp) for t in range(self.tp)]

    def pp_group(self, rank: int) -> list[int]:
        """Ranks of the pipeline that holds ``rank`` (same tp and dp), ordered by stage."""
        c = self.coords(rank)
        return [self.rank(c.tp, p, c.dp) for p in range(self.pp)]

    def dp_group(self, rank: int) -> list[int]:
        """Ranks holding the same model shard as ``rank`` (same tp and pp), ordered by dp rank."""
        c = self.coords(rank)
        return [self.rank(c.tp, c.pp, d) for d in range(self.dp)]

    def tp_groups(self) -> list[list[int]]:
        return _distinct(self.tp_group(r) for r in range(self.world_size))

    def pp_groups(self) -> list[list[int]]:
        return _distinct(self.pp_group(r) for r in range(self.world_size))

    def dp_groups(self) -> list[list[int]]:
        return _distinct(self.dp_group(r) for r in range(self.world_size))

    def ep_rank(self, rank: int) -> int:
        """``rank``'s position in its expert-parallel group (which slice of the experts it holds)."""
        return self.coords(rank).dp % self.ep

    def ep_group(self, rank: int) -> list[int]:
        """Ranks that split the experts ``rank``'s stage holds: ``ep`` consecutive DP ranks, ordered by EP rank."""
        c = self.coords(rank)
        first = c.dp - c.dp % self.ep
        return [self.rank(c.tp, c.pp, d) for d in range(first, first + self.ep)]

    def expert_dp_group(self, rank: int) -> list[int]:
        """Ranks holding the same experts as ``rank`` (same tp, pp and EP rank), ordered by DP rank."""
        c = self.coords(rank)
        return [self.rank(c.tp, c.pp, d) for d in range(c.dp % self.ep, self.dp, self.ep)]

    def ep_groups(self) -> list[list[int]]:
        return _distinct(self.ep_group(r) for r in range(self.world_size))

    def expert_dp_groups(self) -> list[list[int]]:
        return _distinct(self.expert_dp_group(r) for r in range(self.world_size))

    def model_parallel_group(self, rank: int) -> list[int]:
        """All ranks of one model replica (TP x PP) holding ``rank``."""
        c = self.coords(rank)
        return sorted(self.rank(t, p, c.dp) for t in range(self.tp) for p in range(self.pp))

    # --- nodes ----------------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        g = self._require_gpus_per_node()
        return -(-self.world_size // g)

    def node(self, rank: int) -> int:
        """Node index of ``rank``: ranks fill nodes in order, ``gpus_per_node`` per node (torchrun/SLURM convention)."""
        self._check_rank(rank)
        return rank // self._require_gpus_per_node()

    def node_ranks(self, node: int) -> list[int]:
        g = self._require_gpus_per_node()
        return [r for r in range(node * g, min((node + 1) * g, self.world_size))]

    def tp_groups_within_nodes(self) -> bool:
        """True when every TP group lies inside one node (TP traffic stays on NVLink)."""
        return all(len({self.node(r) for r in group}) == 1 for group in self.tp_groups())

    # --- helpers --------------------------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size} ({self})")

    def _require_gpus_per_node(self) -> int:
        if self.gpus_per_node is None:
            raise ValueError("this layout has no gpus_per_node; build it with gpus_per_node=N for node queries")
        return self.gpus_per_node

    def __str__(self) -> str:
        ep = f" EP={self.ep}" if self.ep > 1 else ""
        return f"TP={self.tp} PP={self.pp} DP={self.dp}{ep} (world {self.world_size})"

    @classmethod
    def of(cls, parallel, gpus_per_node: int | None = None) -> ParallelLayout:
        """The layout of a recipe's ``*.parallel`` section (``ParallelConfig``)."""
        return cls(tp=parallel.tp, pp=parallel.pp, dp=parallel.dp, ep=parallel.ep, gpus_per_node=gpus_per_node)


def _distinct(groups) -> list[list[int]]:
    seen: dict[tuple[int, ...], None] = {}
    for g in groups:
        seen.setdefault(tuple(g), None)
    return [list(g) for g in seen]


def prompt_slice(num_prompts: int, engine: int, engines: int) -> range:
    """The contiguous prompts engine ``engine`` of ``engines`` generates (sizes differ by at most one)."""
    base, extra = divmod(num_prompts, engines)
    start = engine * base + min(engine, extra)
    return range(start, start + base + (1 if engine < extra else 0))


@dataclass(frozen=True)
class Pool:
    """One pool: its global ranks (contiguous) and the roles it hosts."""

    name: str
    ranks: range
    roles: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def local(self, rank: int) -> int:
        """``rank``'s index inside this pool."""
        return self.ranks.index(rank)


def parse_ranks(text) -> range:
    """'a-b' (inclusive) or a single rank, as a range."""
    text = str(text).strip()
    lo, sep, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"ranks: {text!r} is not 'a-b' or a single rank") from None
    if first < 0 or last < first:
        raise ValueError(f"ranks: {text!r} is not an increasing range of ranks >= 0")
    return range(first, last + 1)


def pool_of(pools: list[Pool], rank: int) -> Pool:
    for p in pools:
        if rank in p.ranks:
            return p
    raise ValueError(f"rank {rank} is in no pool")
