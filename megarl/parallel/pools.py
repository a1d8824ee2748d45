"""Resource pools: disjoint, contiguous rank ranges of one torchrun launch, each with a default process group of its
own ranks only.

vLLM's external launcher and Megatron's ``parallel_state`` both build on the whole default process group
(``../shared/facts/pools-and-async.md`` section 1.1), so a launch cannot simply be split between them. Instead every
process joins a default group that holds only its pool, rendezvoused on torchrun's own store under a per-pool prefix
(no new port); Megatron and vLLM then run unchanged inside their pool. While vLLM builds an engine, ``RANK`` must be
the pool rank (vLLM reads it from the environment); ``LOCAL_RANK`` stays the node-local index (the GPU).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.parallel.comm import GroupComm, WorldComm
from megarl.parallel.layout import Pool, pool_of

_launch = {"store": None, "joins": 0}  # torchrun's store, once this process joined its pool; not a cache


def init_pool_group(pools: list[Pool], backend: str, timeout_s: float = 600.0) -> Pool:
    """Join this process's pool: its default process group holds only the pool's ranks (collective over the pool).
    Returns the pool."""
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    covered = sorted(r for p in pools for r in p.ranks)
    if covered != list(range(world)):
        raise ValueError(f"the pools cover ranks {covered}, the launch has {world}")
    pool = pool_of(pools, rank)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"megarl/pool/{pool.name}", store),
        rank=pool.local(rank),
        world_size=pool.size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _launch["store"] = store
    return pool


def launch_store() -> dist.Store:
    """The launch's store (groups across pools rendezvous on it); only after ``init_pool_group``."""
    if _launch["store"] is None:
        raise RuntimeError("launch_store: this process has not joined a pool (init_pool_group)")
    return _launch["store"]


@contextlib.contextmanager
def pool_rank_env(pool: Pool, rank: int):
    """``RANK``/``WORLD_SIZE`` set to the pool's view inside the block (vLLM builds its engine from them)."""
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(pool.local(rank)), WORLD_SIZE=str(pool.size))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Placement:
    """Where this process's work is, and how values cross to the ranks of other roles.

    Colocated (no pools): every role on every rank; ``share`` hands a value through unchanged, ``barrier`` and
    ``any`` are the default group's. With pools: this rank hosts its pool's roles; ``comm`` spans every rank of the
    launch (``megarl.parallel.comm.GroupComm``) and carries what one pool computed to the others."""

    rank: int
    """This process's rank in the launch."""
    world: int
    """Ranks in the launch."""
    pools: list[Pool] = field(default_factory=list)
    """[] when colocated."""
    comm: object = None
    """Every rank of the launch: ``WorldComm`` colocated, a ``GroupComm`` across pools."""
    members: tuple[int, ...] = ()
    """The launch ranks ``comm`` spans, in its rank order; () = every rank (``without`` leaves a pool out)."""

    @classmethod
    def colocated(cls) -> Placement:
        return cls(dist.get_rank(), dist.get_world_size(), [], WorldComm())

    @classmethod
    def join(cls, pools: list[Pool], backend: str, timeout_s: float = 600.0, wait_s: float = 86400.0) -> Placement:
        """Collective over the launch: join this rank's pool (``init_pool_group``; once per process; its collectives
        time out after ``timeout_s``) and the group across pools, whose calls may wait a whole phase of another pool
        (generation, an update, a save): ``wait_s``."""
        if _launch["store"] is None:
            init_pool_group(pools, backend, timeout_s)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _launch["joins"] += 1  # a new group per join (a second job in this process), the same count on every rank
        comm = GroupComm(f"placement-{_launch['joins']}", launch_store(), rank, world, wait_s)
        return cls(rank, world, pools, comm)

    def without(self, role: str) -> Placement:
        """The same pools, with ``comm`` over every rank but those of ``role``'s pool (collective over them; once per
        job): the training pools share the learning phases among themselves while the rollout pool generates ahead
        (``async_training.mode=one_step_off``)."""
        members = tuple(r for r in range(self.world) if r not in self.ranks(role))
        comm = GroupComm(f"{self.comm.name}-without-{role}", launch_store(), members.index(self.rank), len(members),
                         self.comm.timeout_s)  # fmt: skip
        return Placement(self.rank, self.world, self.pools, comm, members)

    @property
    def pooled(self) -> bool:
        return bool(self.pools)

    @property
    def pool(self) -> Pool | None:
        return pool_of(self.pools, self.rank) if self.pools else None

    def hosts(self, role: str) -> bool:
        return not self.pools or role in self.pool.roles

    def ranks(self, role: str) -> range:
        """The launch ranks of ``role``'s pool (colocated: all)."""
        return next((p.ranks for p in self.pools if role in p.roles), range(self.world))

    def pool_name(self, role: str) -> str:
        """The name of ``role``'s pool ('' colocated)."""
        return next((p.name for p in self.pools if role in p.roles), "")

    @property
    def leader(self) -> bool:
        """The rank that prints, tracks and writes the run's files: the actor's pool's first rank."""
        return self.rank == self.ranks("actor").start

    def share(self, value, role: str):
        """``value`` as computed on ``role``'s pool (its first rank's), on every rank; colocated: ``value``."""
        if not self.pooled:
            return value
        src = self.ranks(role).start
        return self.comm.broadcast_object(value, src=self.members.index(src) if self.members else src)

    def compute_on(self, role: str, compute):
        """``compute()`` on ``role``'s pool, its result (the pool's first rank's) on every rank. An exception there is
        raised on every rank (elsewhere as a RuntimeError naming it), so no pool waits for one that failed.
        Colocated: ``compute()``."""
        if not self.pooled:
            return compute()
        result, error = None, None
        if self.hosts(role):
            try:
                result = compute()
            except Exception as e:  # noqa: BLE001 -- shared below, then raised on every rank
                error = e
        result, failure = self.share((result, None if error is None else f"{type(error).__name__}: {error}"), role)
        if error is not None:
            raise error
        if failure is not None:
            raise RuntimeError(f"the {role}'s pool failed: {failure}")
        return result

    def barrier(self) -> None:
        if not self.pooled:
            dist.barrier()
        else:
            self.comm.barrier()

    def any(self, flag: bool) -> bool:
        """Collective: whether ``flag`` is set on any rank."""
        t = torch.tensor([1.0 if flag else 0.0])
        if self.comm.size > 1:
            self.comm.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def engine_env(self):
        """The environment vLLM builds an engine in: the pool's ranks when pooled (``pool_rank_env``)."""
        return pool_rank_env(self.pool, self.rank) if self.pooled else contextlib.nullcontext()
