"""Run a Plan over torch.distributed in byte-bounded buckets, and verify every destination shard by hash.

Every rank walks the same transfer list in the same order and cuts it into the same buckets (a transfer larger than a
bucket is split by rows). Per bucket a rank packs what it sends into one buffer per peer, posts isend/irecv, waits,
then unpacks into its destination shards. Local pieces are copied directly, with no buffer. So the executor's own
memory is at most one bucket of send buffers plus one of receive buffers (single-buffered: <= 2 buckets).

Verification (on by default): the sender hashes each piece it sends, after casting and before sending, with weights
that depend on the piece's position in the destination shard; the receiver hashes each assembled shard the same
way. The hash is additive over pieces, so the per-shard sums must agree. A mismatch raises ReshardVerificationError
naming the tensor and the ranks involved.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megarl.parallel.comm import WorldComm
from megarl.reshard.plan import Plan, Transfer

_MASK64 = (1 << 64) - 1
_ROW_MULT = 0x3C6EF372FE94F82A  # even, so every weight i * _ROW_MULT + 1 is odd (int64 arithmetic wraps)
_COL_MULT = 0x5851F42D4C957F2C  # even, likewise
_HASH_CHUNK = 1 << 16  # elements hashed at a time on CPU (fits in cache: faster than larger chunks)
_HASH_CHUNK_GPU = 1 << 24  # on GPU: few large kernels
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def moves_cuda_tensors(backend: str) -> bool:
    """Whether a process group of ``backend`` moves CUDA tensors: ``nccl``, or a per-device list that routes
    ``cuda`` to a backend (the default group on GPU is ``cpu:gloo,cuda:nccl``)."""
    if ":" not in backend:
        return backend == "nccl"
    return any(part.split(":", 1)[0].strip() == "cuda" for part in backend.split(","))


def comm_device() -> torch.device:
    """Where transfer buffers live and hashes run: this rank's device (``rank_device``: its GPU, or the CPU shim's
    stand-in) when the default group moves CUDA tensors, the CPU under gloo alone."""
    if dist.is_initialized() and moves_cuda_tensors(str(dist.get_backend())):
        from megarl.models.builder import rank_device  # here: Megatron's model code only for CUDA tensors

        return rank_device()
    return torch.device("cpu")


class ReshardVerificationError(RuntimeError):
    """A destination shard's hash does not match what its senders hashed."""


def position_hash(values: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int] | None) -> int:
    """sum_ij a_i * (bits(v_ij) * b_j mod 2^w) mod 2^64, with (i, j) the element's place in the destination shard,
    w the element width in bits and odd weights a_i = i * ROW_MULT + 1, b_j = (j * COL_MULT + 1) mod 2^w.

    Any single changed element changes the hash (odd weights are invertible), moved rows or columns change it too, and
    the sum is additive over pieces, so senders' piece hashes add up to the receiver's shard hash. The column product
    stays in the element's own integer width (no widening copy), so hashing costs about one tensor copy. It runs
    ``_HASH_CHUNK`` elements at a time: temporaries stay small whatever the tensor size."""
    bits_all = values.contiguous().view(_INT_VIEW[values.element_size()])
    height = rows[1] - rows[0]
    bits_all = bits_all.reshape(height, -1)
    device = values.device
    col_w = None
    if cols is not None:
        col_w = torch.arange(cols[0], cols[1], dtype=torch.int64, device=device) * _COL_MULT + 1
        col_w = col_w.to(bits_all.dtype)  # keeps the low bits: still odd
    chunk = _HASH_CHUNK if device.type == "cpu" else _HASH_CHUNK_GPU
    step = max(1, chunk // bits_all.shape[1])
    acc = torch.zeros((), dtype=torch.int64, device=device)  # int64 wraps: exact mod 2^64, one sync at the end
    for lo in range(0, height, step):
        hi = min(lo + step, height)
        block = bits_all[lo:hi]
        per_row = block[:, 0].to(torch.int64) if col_w is None else (block * col_w).sum(1)
        row_w = torch.arange(rows[0] + lo, rows[0] + hi, dtype=torch.int64, device=device) * _ROW_MULT + 1
        acc += (per_row * row_w).sum()
    total = int(acc)
    return total & _MASK64


@dataclass
class SyncStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    peak_buffer_bytes: int = 0
    buckets: int = 0


def _split(t: Transfer, max_numel: int) -> list[Transfer]:
    """Split a transfer by rows into pieces of at most ``max_numel`` elements (at least one row each)."""
    row_numel = t.numel // (t.dst_rows[1] - t.dst_rows[0])
    rows_per = max(1, max_numel // row_numel)
    out = []
    for lo in range(0, t.dst_rows[1] - t.dst_rows[0], rows_per):
        hi = min(lo + rows_per, t.dst_rows[1] - t.dst_rows[0])
        out.append(
            replace(
                t, src_rows=(t.src_rows[0] + lo, t.src_rows[0] + hi), dst_rows=(t.dst_rows[0] + lo, t.dst_rows[0] + hi)
            )
        )
    return out


def buckets(plan: Plan, bucket_bytes: int, element_size: int) -> list[list[Transfer]]:
    """The plan's transfers cut into buckets of at most ``bucket_bytes`` communicated bytes (same on every rank)."""
    max_numel = max(1, bucket_bytes // element_size)
    out, current, size = [], [], 0
    for t in plan.transfers:
        pieces = [t] if t.src_rank == t.dst_rank else _split(t, max_numel)
        for piece in pieces:
            nbytes = 0 if piece.src_rank == piece.dst_rank else piece.numel * element_size
            if current and (size + nbytes > bucket_bytes or piece.phase != current[-1].phase):
                out.append(current)
                current, size = [], 0
            current.append(piece)
            size += nbytes
    if current:
        out.append(current)
    return out


def _region(tensor: torch.Tensor, rows, cols) -> torch.Tensor:
    view = tensor[rows[0] : rows[1]]
    return view if cols is None else view[:, cols[0] : cols[1]]


def execute(
    plan: Plan,
    src_tensors: dict[str, torch.Tensor],
    dst_tensors: dict[str, torch.Tensor],
    *,
    bucket_bytes: int = 512 * 1024**2,
    verify: bool = True,
    compare_full: bool = False,
    dtype: torch.dtype | None = None,
    on_send: Callable[[Transfer, torch.Tensor], None] | None = None,
    comm=None,
) -> SyncStats:
    """Collective: fill this rank's ``dst_tensors`` (preallocated, destination dtype) from every rank's ``src_tensors``.

    ``compare_full`` (debug): additionally every sender ships a copy of each piece it produced through a separate
    path (object all-gather, not the bucketed point-to-point one) and receivers compare their assembled regions
    element by element. Memory-heavy: every rank sees every piece of the plan at once.
    ``on_send`` is a test hook called on each packed piece after it was hashed (e.g. to corrupt it in transit).
    ``comm`` (``megarl.parallel.comm``): the group the plan's rank ids refer to; default the default process group.
    """
    comm = comm or WorldComm()
    if dtype is None:
        dtype = next(iter(dst_tensors.values())).dtype if dst_tensors else torch.float32
    run = _Execution(comm, src_tensors, dst_tensors, dtype, verify, compare_full, on_send)
    for r, shard, rows, cols in plan.padding:
        if r == comm.rank:
            _region(dst_tensors[shard], rows, cols).zero_()
    for bucket in buckets(plan, bucket_bytes, run.esize):
        run.bucket(bucket)
    if verify:
        _verify(plan, comm, dst_tensors, run.expected, run.device)
    if compare_full:
        _compare_full(comm, dst_tensors, run.copies)
    return run.stats


class _Execution:
    """One rank's side of ``execute``: its buckets' copies, sends and receives, and what it produced (hashes per
    destination shard for the verification; whole copies with ``compare_full``)."""

    def __init__(self, comm, src_tensors, dst_tensors, dtype: torch.dtype, verify: bool, compare_full: bool, on_send):
        self.comm, self.rank = comm, comm.rank
        self.src_tensors, self.dst_tensors, self.dtype = src_tensors, dst_tensors, dtype
        self.verify, self.compare_full, self.on_send = verify, compare_full, on_send
        self.device = comm_device()
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.stats = SyncStats()
        self.expected: dict[tuple[int, str], int] = defaultdict(int)
        """Hashes of the pieces this rank produced, per destination shard."""
        self.copies: list[tuple[Transfer, torch.Tensor]] = []
        """``compare_full``: what this rank produced, as produced."""

    def source_view(self, t: Transfer) -> torch.Tensor:
        return _region((self.dst_tensors if t.from_dst else self.src_tensors)[t.src_shard], t.src_rows, t.src_cols)

    def record(self, t: Transfer, values: torch.Tensor) -> None:
        if self.compare_full:
            self.copies.append((t, values.detach().cpu().clone()))
        if self.verify:
            key = (t.dst_rank, t.dst_shard)
            self.expected[key] = (self.expected[key] + position_hash(values, t.dst_rows, t.dst_cols)) & _MASK64

    def bucket(self, bucket: list[Transfer]) -> None:
        """Collective: the bucket's local copies, then one exchange of packed buffers with the peers, unpacked."""
        stats, esize = self.stats, self.esize
        stats.buckets += 1
        sends: dict[int, list[Transfer]] = defaultdict(list)
        recvs: dict[int, list[Transfer]] = defaultdict(list)
        for t in bucket:
            if t.src_rank == self.rank and t.dst_rank == self.rank:
                src = self.source_view(t)
                _region(self.dst_tensors[t.dst_shard], t.dst_rows, t.dst_cols).copy_(src)
                self.record(t, src.to(self.dtype))
                stats.bytes_local += t.numel * esize
            elif t.src_rank == self.rank:
                sends[t.dst_rank].append(t)
            elif t.dst_rank == self.rank:
                recvs[t.src_rank].append(t)
        outgoing = [(peer, self.pack(items)) for peer, items in sorted(sends.items())]
        incoming = [(peer, self.buffer(items), items) for peer, items in sorted(recvs.items())]
        stats.bytes_sent += sum(buf.numel() for _, buf in outgoing) * esize
        stats.bytes_received += sum(buf.numel() for _, buf, _ in incoming) * esize
        held = sum(buf.numel() for _, buf in outgoing) + sum(buf.numel() for _, buf, _ in incoming)
        stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, held * esize)
        self.comm.exchange(outgoing, [(peer, buf) for peer, buf, _ in incoming])  # one exchange per bucket
        for _, buf, items in incoming:
            offset = 0
            for t in items:
                target = _region(self.dst_tensors[t.dst_shard], t.dst_rows, t.dst_cols)
                target.copy_(buf[offset : offset + t.numel].view(target.shape))
                offset += t.numel

    def buffer(self, items: list[Transfer]) -> torch.Tensor:
        return torch.empty(sum(t.numel for t in items), dtype=self.dtype, device=self.device)

    def pack(self, items: list[Transfer]) -> torch.Tensor:
        """The pieces for one peer, in order, in one buffer (each recorded, then shown to ``on_send``)."""
        buf, offset = self.buffer(items), 0
        for t in items:
            piece = buf[offset : offset + t.numel]
            piece.view(self.source_view(t).shape).copy_(self.source_view(t))
            self.record(t, piece)
            if self.on_send is not None:
                self.on_send(t, piece)
            offset += t.numel
        return buf


def _compare_full(comm, dst_tensors, copies) -> None:
    rank = comm.rank
    everyone = comm.all_gather_object(copies)
    bad = []
    for sender, pieces in enumerate(everyone):
        for t, values in pieces:
            if t.dst_rank != rank:
                continue
            got = _region(dst_tensors[t.dst_shard], t.dst_rows, t.dst_cols).cpu()
            if not torch.equal(got.reshape(values.shape), values):
                bad.append(f"{t.dst_shard} rows {t.dst_rows} cols {t.dst_cols} on rank {rank} (from rank {sender})")
    problems = [msg for msgs in comm.all_gather_object(bad) for msg in msgs]
    if problems:
        raise ReshardVerificationError("weight sync full comparison failed: " + "; ".join(problems[:20]))


def _verify(plan: Plan, comm, dst_tensors, expected: dict, device) -> None:
    """One all-reduce carries every sender's piece hashes to their destination shards (as two exact 32-bit halves,
    so the sum cannot overflow); each rank compares them with the hashes of the shards it assembled."""
    rank = comm.rank
    keys = [(r, name) for r in sorted(plan.dst_shapes) for name in plan.dst_shapes[r]]
    index = {k: i for i, k in enumerate(keys)}
    sums = torch.zeros(len(keys), 2, dtype=torch.int64)
    for key, h in expected.items():
        sums[index[key]] = torch.tensor([h & 0xFFFFFFFF, h >> 32])
    sums = sums.to(device)
    comm.all_reduce(sums)
    sums = sums.cpu()
    bad = []
    for shard, shape in plan.dst_shapes.get(rank, {}).items():
        lo, hi = (int(v) for v in sums[index[(rank, shard)]])
        t = dst_tensors[shard]
        got = position_hash(t, (0, shape[0]), None if t.dim() == 1 else (0, shape[1]))
        if got != ((hi << 32) + lo) & _MASK64:
            senders = sorted({x.src_rank for x in plan.transfers if x.dst_rank == rank and x.dst_shard == shard})
            bad.append(f"{shard} on rank {rank} (pieces sent by ranks {senders})")
    flag = torch.tensor([len(bad)], device=device)
    comm.all_reduce(flag)
    if int(flag.item()):
        problems = [msg for msgs in comm.all_gather_object(bad) for msg in msgs]
        raise ReshardVerificationError("weight sync verification failed: hash mismatch for " + "; ".join(problems))
