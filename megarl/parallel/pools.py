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
from dataclasses import dataclass

import torch.distributed as dist

_launch = {"store": None}  # torchrun's store, once this process joined its pool; not a cache


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


def init_pool_group(pools: list[Pool], backend: str, timeout_s: float = 600.0) -> Pool:
    """Join this process's pool: its default process group holds only the pool's ranks (collective over the pool).
    Returns the pool."""
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
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
