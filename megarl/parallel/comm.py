"""The executor's communication: this rank's id in the plan, the point-to-point exchange of one bucket, and the small
collectives of verification.

- ``WorldComm``: the default process group (colocated: the plan's rank ids are the torchrun ranks).
- ``GroupComm``: a group over the ranks of several pools (resource pools: every process's default group holds
  only its pool, ``megarl.parallel.pools``), built on torchrun's store under a prefix. Such a group is not
  registered with ``torch.distributed``, so ``batch_isend_irecv`` and the object collectives refuse it
  (facts/pools-and-async.md section 1.2): it posts raw sends and receives and moves objects as byte tensors.
  Host tensors go over gloo. On CUDA the group also has an NCCL backend (``nccl_group``): CUDA tensors (the weight
  sync's buckets and hashes) go over it, a bucket's sends and receives coalesced into one NCCL group call as
  ``batch_isend_irecv`` does for a registered group (unbatched mutual sends would deadlock).
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist


class WorldComm:
    """The default process group."""

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        """Send and receive one bucket's buffers (one batched call: NCCL needs a rank's sends and receives grouped,
        or two ranks that exchange pieces can each block in a send queued before the matching receive)."""
        ops = [dist.P2POp(dist.isend, t, peer) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for peer, t in recvs]
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        dist.all_reduce(t, op=op)

    def all_gather_object(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj, src: int):
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]


class GroupComm:
    """A gloo group ``name`` of ``size`` ranks on the launch's store: every pool's ranks (0..size-1 = the launch's),
    or some pools' (``Placement.without``)."""

    def __init__(self, name: str, store: dist.Store, rank: int, size: int, timeout_s: float = 600.0):
        self.name, self.rank, self.size, self.timeout_s = name, rank, size, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"megarl/x/{name}", store), rank, size, timeout)
        self.cuda = nccl_group(dist.PrefixStore(f"megarl/x/{name}/cuda", store), rank, size, timeout) if (
            torch.cuda.is_available()) else None  # fmt: skip
        """The NCCL side of the group (None without CUDA)."""

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        """One bucket's buffers: CUDA buffers over NCCL in one coalesced call; host buffers over gloo, whose
        point-to-point calls are asynchronous: post everything, then wait."""
        if self.cuda is not None and any(t.is_cuda for _, t in (*sends, *recvs)):
            coalesced_exchange(self.cuda, sends, recvs)
            return
        staged = [(peer, t, t.cpu()) for peer, t in recvs]
        works = [self.pg.send([t.cpu()], peer, 0) for peer, t in sends]
        works += [self.pg.recv([host], peer, 0) for peer, _, host in staged]
        for w in works:
            w.wait()
        for _, t, host in staged:
            if host is not t:
                t.copy_(host)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        if self.cuda is not None and t.is_cuda:
            self.cuda.allreduce([t], opts).wait()
            return
        host = t.cpu()
        self.pg.allreduce([host], opts).wait()
        if host is not t:
            t.copy_(host)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))

    def all_gather_object(self, obj) -> list:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.pg.allgather([sizes], [torch.tensor([data.numel()])]).wait()
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        everyone = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.pg.allgather([everyone], [padded]).wait()
        return [pickle.loads(t[: int(s.item())].numpy().tobytes()) for t, s in zip(everyone, sizes)]

    def broadcast_object(self, obj, src: int):
        """``obj`` from rank ``src`` to every rank (a step's batch from the rollout pool to the train pool)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == src else None
        size = torch.tensor([data.numel() if data is not None else 0])
        self.pg.broadcast(size, src).wait()
        buf = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast(buf, src).wait()
        return obj if self.rank == src else pickle.loads(buf.numpy().tobytes())


def nccl_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    """An unregistered process group whose CUDA backend is NCCL (as ``torch.distributed.new_group`` builds one,
    without the default group's ranks: a group across pools), its communicator set up by one all-reduce of every
    member (NCCL's first call on a group must include all of its ranks; later coalesced point-to-point calls may
    involve some)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.is_high_priority_stream = False
    backend = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
    backend._set_sequence_number_for_group()
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
    pg.allreduce([torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))]).wait()
    return pg


def coalesced_exchange(pg, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
    """A rank's sends and receives of one bucket in one NCCL group call (``torch.distributed._coalescing_manager``
    for a backend that supports coalescing): each rank's ops are queued, then launched together, so two ranks that
    exchange pieces cannot each block in a send queued before the matching receive."""
    tensors = [t for _, t in (*sends, *recvs)]
    if not tensors:
        return
    device = tensors[0].device
    pg._start_coalescing(device)
    for peer, t in sends:
        pg.send([t], peer, 0)
    for peer, t in recvs:
        pg.recv([t], peer, 0)
    pg._end_coalescing(device).wait()
