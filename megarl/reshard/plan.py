"""plan(src, dst): a pure function over shapes that says, per destination shard, which slice comes from which rank.

Rules, in order: a byte the destination rank already holds is a local copy (no communication); otherwise a source on
the same node is preferred; otherwise, when several ranks of one node need the same remote slice, it crosses the
network once (to the first of them) and is forwarded inside the node (phase 1). Among equal choices the least loaded
source (bytes sent by its node, then by itself) wins, which spreads the work over DP replicas. No byte is scheduled
twice: every destination element has exactly one transfer or is padding.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from megarl.reshard.layout import Block, SideLayout

LOCAL, SAME_NODE, CROSS_NODE = "same_rank", "same_node", "cross_node"


@dataclass(frozen=True)
class Transfer:
    """Copy src[rows, cols] of ``src_rank``'s tensor into dst[rows, cols] of ``dst_rank``'s shard."""

    src_rank: int
    from_dst: bool
    """True for a forward: the source is the sender's already-filled destination shard."""
    src_shard: str
    src_rows: tuple[int, int]
    src_cols: tuple[int, int] | None
    dst_rank: int
    dst_shard: str
    dst_rows: tuple[int, int]
    dst_cols: tuple[int, int] | None
    hf: str
    phase: int

    @property
    def numel(self) -> int:
        return (self.dst_rows[1] - self.dst_rows[0]) * (
            1 if self.dst_cols is None else self.dst_cols[1] - self.dst_cols[0]
        )


@dataclass
class Plan:
    transfers: list[Transfer]
    padding: list[tuple[int, str, tuple[int, int], tuple[int, int] | None]]
    """(rank, shard, rows, cols) regions that have no source: zero-filled by the receiver."""
    dst_shapes: dict[int, dict[str, tuple[int, ...]]]
    src_shapes: dict[int, dict[str, tuple[int, ...]]]
    gpus_per_node: int

    def link(self, t: Transfer) -> str:
        if t.src_rank == t.dst_rank:
            return LOCAL
        same = t.src_rank // self.gpus_per_node == t.dst_rank // self.gpus_per_node
        return SAME_NODE if same else CROSS_NODE


def _cuts(lo: int, hi: int, edges) -> list[tuple[int, int]]:
    points = sorted({lo, hi, *(e for e in edges if lo < e < hi)})
    return list(zip(points[:-1], points[1:]))


def _contains(b: Block, rows, cols) -> bool:
    return (
        b.rows[0] <= rows[0]
        and rows[1] <= b.rows[1]
        and (cols is None or (b.cols[0] <= cols[0] and cols[1] <= b.cols[1]))
    )


def _place(b: Block, rows, cols):
    """Where the HF rectangle (rows, cols) sits inside the shard that holds block ``b``."""
    r = (b.row_off + rows[0] - b.rows[0], b.row_off + rows[1] - b.rows[0])
    c = None if cols is None else (b.col_off + cols[0] - b.cols[0], b.col_off + cols[1] - b.cols[0])
    return r, c


def plan(src: SideLayout, dst: SideLayout) -> Plan:
    """Transfers that fill every destination shard of ``dst`` from the shards of ``src`` (see module docstring)."""
    if src.gpus_per_node != dst.gpus_per_node:
        raise ValueError("source and destination must agree on gpus_per_node")
    gpn = src.gpus_per_node
    holders = _holders(src)
    rank_load: dict[int, int] = defaultdict(int)  # bytes a rank sends (any link) or receives across nodes
    node_load: dict[int, int] = defaultdict(int)  # bytes a node sends across nodes
    transfers, forwards, padding = [], [], []
    remote: dict[tuple, list] = defaultdict(list)  # (node, hf, rows, cols) -> [(dst_rank, shard, db, candidates)]

    def emit(source, dst_rank, shard_name, db, rows, cols, phase, from_dst):
        s_rank, s_name, s_b = source
        numel = (rows[1] - rows[0]) * (1 if cols is None else cols[1] - cols[0])
        if s_rank != dst_rank:
            rank_load[s_rank] += numel
            if s_rank // gpn != dst_rank // gpn:
                node_load[s_rank // gpn] += numel
                rank_load[dst_rank] += numel
        src_r, src_c = _place(s_b, rows, cols)
        dst_r, dst_c = _place(db, rows, cols)
        t = Transfer(s_rank, from_dst, s_name, src_r, src_c, dst_rank, shard_name, dst_r, dst_c, db.hf, phase)
        (forwards if phase else transfers).append(t)

    # pass 1: pieces held by the destination rank itself or by a rank of its node; collect the rest
    for dst_rank in sorted(dst.ranks):
        dst_node = dst_rank // gpn
        for shard in dst.ranks[dst_rank]:
            for db in shard.blocks:
                if db.hf is None:
                    padding.append((dst_rank, shard.name, *_place(db, db.rows, db.cols)))
                    continue
                for rows, cols, cands in _pieces(db, holders[db.hf]):
                    local = [h for h in cands if h[0] == dst_rank]
                    near = [h for h in cands if h[0] // gpn == dst_node]
                    if local or near:
                        source = (local or sorted(near, key=lambda h: (rank_load[h[0]], h[0])))[0]
                        emit(source, dst_rank, shard.name, db, rows, cols, 0, False)
                    else:
                        remote[(dst_node, db.hf, rows, cols)].append((dst_rank, shard.name, db, cands))
    # pass 2: each remote slice crosses the network once per node, to the least loaded of the ranks that need it,
    # from the least loaded source node / rank; the receiver forwards it to the node's other ranks (phase 1)
    for (_, _, rows, cols), needs in remote.items():
        receiver = min(needs, key=lambda n: (rank_load[n[0]], n[0]))
        cands = receiver[3]
        source = min(cands, key=lambda h: (node_load[h[0] // gpn], rank_load[h[0]], h[0]))
        emit(source, receiver[0], receiver[1], receiver[2], rows, cols, 0, False)
        for other in needs:
            if other is not receiver:
                emit((receiver[0], receiver[1], receiver[2]), other[0], other[1], other[2], rows, cols, 1, True)
    return Plan(
        transfers=transfers + forwards,
        padding=padding,
        dst_shapes={r: {s.name: s.shape for s in shards} for r, shards in dst.ranks.items()},
        src_shapes={r: {s.name: s.shape for s in shards} for r, shards in src.ranks.items()},
        gpus_per_node=gpn,
    )


def _holders(src: SideLayout) -> dict[str, list[tuple[int, str, Block]]]:
    """HF tensor name -> every (rank, shard, block) of ``src`` that holds a part of it."""
    holders: dict[str, list[tuple[int, str, Block]]] = defaultdict(list)
    for rank, shards in src.ranks.items():
        for shard in shards:
            for b in shard.blocks:
                if b.hf is not None:
                    holders[b.hf].append((rank, shard.name, b))
    return holders


def _pieces(db: Block, holders: list[tuple[int, str, Block]]):
    """Destination block ``db`` cut where the source blocks' edges fall: (rows, cols, the holders containing the
    piece whole), row-major."""
    cands_all = [h for h in holders if _overlaps(h[2], db)]
    if not cands_all:
        raise ValueError(f"no source holds {db.hf} rows {db.rows} cols {db.cols}")
    row_cuts = _cuts(*db.rows, [e for h in cands_all for e in h[2].rows])
    col_cuts = [None] if db.cols is None else _cuts(*db.cols, [e for h in cands_all for e in h[2].cols])
    for rows in row_cuts:
        for cols in col_cuts:
            yield rows, cols, [h for h in cands_all if _contains(h[2], rows, cols)]


def _overlaps(b: Block, db: Block) -> bool:
    rows_ok = b.rows[0] < db.rows[1] and db.rows[0] < b.rows[1]
    cols_ok = db.cols is None or (b.cols[0] < db.cols[1] and db.cols[0] < b.cols[1])
    return rows_ok and cols_ok


def plan_stats(p: Plan, bytes_per_element: int) -> dict:
    """Bytes by link class, and the busiest rank / node, for this plan."""
    by_link: dict[str, int] = defaultdict(int)
    sent: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    node_sent: dict[int, int] = defaultdict(int)
    node_recv: dict[int, int] = defaultdict(int)
    gpn = p.gpus_per_node
    for t in p.transfers:
        n = t.numel * bytes_per_element
        link = p.link(t)
        by_link[link] += n
        if link != LOCAL:
            sent[t.src_rank] += n
            recv[t.dst_rank] += n
        if link == CROSS_NODE:
            node_sent[t.src_rank // gpn] += n
            node_recv[t.dst_rank // gpn] += n
    return {
        "bytes_moved": by_link[SAME_NODE] + by_link[CROSS_NODE],
        "bytes_local": by_link[LOCAL],
        "bytes_same_node": by_link[SAME_NODE],
        "bytes_cross_node": by_link[CROSS_NODE],
        "max_rank_send": max(sent.values(), default=0),
        "max_rank_recv": max(recv.values(), default=0),
        "max_node_send": max(node_sent.values(), default=0),
        "max_node_recv": max(node_recv.values(), default=0),
    }


def theoretical_minimum(src: SideLayout, dst: SideLayout, bytes_per_element: int) -> dict:
    """Lower bounds, computed on a grid of HF cells independent of the planner:
    ``rank_min``: bytes some destination rank needs that it does not hold itself;
    ``node_min``: bytes some node needs that no rank of that node holds (each counted once per node)."""
    gpn = src.gpus_per_node
    blocks: dict[str, list[tuple[str, int, Block]]] = defaultdict(list)
    for side, layout in (("src", src), ("dst", dst)):
        for rank, shards in layout.ranks.items():
            for shard in shards:
                for b in shard.blocks:
                    if b.hf is not None:
                        blocks[b.hf].append((side, rank, b))
    rank_min = node_min = 0
    for entries in blocks.values():
        row_edges = sorted({e for _, _, b in entries for e in b.rows})
        col_edges = [None] if entries[0][2].cols is None else sorted({e for _, _, b in entries for e in b.cols})
        for rows in zip(row_edges[:-1], row_edges[1:]):
            for cols in [None] if col_edges == [None] else zip(col_edges[:-1], col_edges[1:]):
                held = {r for side, r, b in entries if side == "src" and _contains(b, rows, cols)}
                needed = {r for side, r, b in entries if side == "dst" and _contains(b, rows, cols)}
                numel = (rows[1] - rows[0]) * (1 if cols is None else cols[1] - cols[0])
                rank_min += numel * len(needed - held)
                held_nodes = {r // gpn for r in held}
                node_min += numel * len({r // gpn for r in needed} - held_nodes)
    return {"rank_min": rank_min * bytes_per_element, "node_min": node_min * bytes_per_element}


def flows_of_plan(p: Plan) -> dict[tuple[int, int], int]:
    """Elements sent from rank a to rank b (a != b), over all transfers of the plan."""
    flows = defaultdict(int)
    for t in p.transfers:
        if t.src_rank != t.dst_rank:
            flows[(t.src_rank, t.dst_rank)] += t.numel
    return flows


def summarize(flows: dict, bpe: int, gpn: int, ib_gbs: float, nvlink_gbs: float) -> dict:
    """Bytes of a set of rank-to-rank flows by link class, the busiest rank and node, and an estimated time: the
    slowest rank's max(sent, received) over NVLink plus over InfiniBand, at the given GB/s per GPU (links in
    parallel across ranks, no overlap of the two classes; latency ignored)."""
    sent, recv = defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0])  # [same node, cross node]
    node_sent, node_recv = defaultdict(int), defaultdict(int)
    total = cross = 0
    for (a, b), numel in flows.items():
        n = numel * bpe
        far = int(a // gpn != b // gpn)
        total += n
        cross += n * far
        sent[a][far] += n
        recv[b][far] += n
        if far:
            node_sent[a // gpn] += n
            node_recv[b // gpn] += n
    ranks = set(sent) | set(recv)
    nv, ib = nvlink_gbs * 1e9, ib_gbs * 1e9
    est = max((max(sent[r][0], recv[r][0]) / nv + max(sent[r][1], recv[r][1]) / ib for r in ranks), default=0.0)
    return {
        "moved": total,
        "cross": cross,
        "rank_send": max((sum(v) for v in sent.values()), default=0),
        "rank_recv": max((sum(v) for v in recv.values()), default=0),
        "node_send": max(node_sent.values(), default=0),
        "node_recv": max(node_recv.values(), default=0),
        "est_s": est,
    }
