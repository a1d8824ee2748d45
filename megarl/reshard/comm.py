"""The executor's communication: this rank's id in the plan, the point-to-point exchange of one bucket, and the small
collectives of verification.

- ``WorldComm``: the default process group (colocated: the plan's rank ids are the torchrun ranks).
- ``GroupComm``: a gloo group over the ranks of several pools (resource pools: every process's default group holds
  only its pool, ``megarl.parallel.pools``), built on torchrun's store under a prefix. Such a group is not
  registered with ``torch.distributed``, so ``batch_isend_irecv`` and the object collectives refuse it
  (facts/pools-and-async.md section 1.2): it posts raw sends and receives and moves objects as byte tensors.
  Gloo moves host memory: CUDA tensors are staged through the host (correct on GPU, not fast; an NCCL group is
  the GPU variant still to build).
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

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        """Gloo's point-to-point calls are asynchronous: post everything, then wait."""
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
