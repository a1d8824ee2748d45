"""Weight-sync bytes and time: megarl's plan vs gather-everything (verl-style) vs gather-within-TP (slime-style).

Part 1 (analytic, from shapes alone; runs for 70B in seconds): per model and layout pair, the bytes each scheme moves
(total, across nodes), their ratio to the theoretical minimum, the busiest rank and node, and an estimated sync time
from link bandwidths. Part 2 (measured): the three schemes run for real on 4 gloo ranks on this machine, side by side.

The baselines, as modelled here (per DP replica, each tensor once, no format conversion counted):
- gather-everything (verl's per-tensor generator): every tensor's TP shard is broadcast along the PP group from its
  stage, then all-gathered in the TP group, so every rank materialises every full tensor and the engine slices it;
- gather-within-TP (slime): each TP group all-gathers its own stage's tensors to full size, then the full tensors
  are broadcast along the PP group so every engine rank gets every layer.
Collectives are counted as rings/chains: a ring all-gather sends each rank's successor all chunks but its own, a
chain broadcast sends the whole tensor over each hop. The plan's bytes are exactly its transfers.

    python benchmarks/reshard.py                       # everything (under 5 minutes here)
    python benchmarks/reshard.py --skip-measured --ib-gbs 50 --nvlink-gbs 300
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.reshard.layout import SideLayout, hf_layout, megatron_layout, vllm_layout
from megarl.reshard.plan import flows_of_plan, plan, summarize, theoretical_minimum
from megarl.reshard.sync import run_sync, split_by_layer


def llama_spec(name, hidden, layers, heads, kv, ffn, vocab) -> tuple[str, ModelSpec]:
    return name, ModelSpec(
        family="llama", hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
        head_dim=hidden // heads, ffn_hidden_size=ffn, vocab_size=vocab, padded_vocab_size=-(-vocab // 128) * 128,
        max_position_embeddings=4096, rope_theta=1e4, rope_scaling_factor=None, rms_norm_eps=1e-5,
        tie_word_embeddings=False, qkv_bias=False,
    )  # fmt: skip


LLAMA2_70B = llama_spec("Llama-2-70B", 8192, 80, 64, 8, 28672, 32000)
LLAMA3_8B = llama_spec("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256)
MEASURED = llama_spec("m110 (measured)", 1024, 4, 16, 4, 2816, 32000)

# (model, Megatron (tp, pp, dp), gpus per node, vLLM TP)
ANALYTIC_CASES = [
    (LLAMA2_70B, (4, 8, 2), 8, 4),
    (LLAMA2_70B, (4, 8, 2), 8, 8),
    (LLAMA3_8B, (2, 2, 2), 8, 2),
    (LLAMA3_8B, (4, 2, 4), 8, 8),
]
MEASURED_CASES = [(MEASURED, (2, 2, 1), 4, 2), (MEASURED, (2, 1, 2), 4, 4)]


# --- flows: (src_rank, dst_rank) -> bytes ---------------------------------------------------------------------------
def _shard_numel(side: SideLayout, rank: int) -> int:
    return sum(math.prod(s.shape) for s in side.ranks[rank])


def _ring_allgather(flows, group: list[int], chunk: dict[int, int]) -> None:
    total = sum(chunk[r] for r in group)
    for i, r in enumerate(group):
        nxt = group[(i + 1) % len(group)]
        if nxt != r:
            flows[(r, nxt)] += total - chunk[nxt]


def _chain_broadcast(flows, group: list[int], root: int, nbytes: int) -> None:
    order = group[group.index(root) :] + group[: group.index(root)]
    for a, b in zip(order, order[1:]):
        flows[(a, b)] += nbytes


def flows_gather_everything(layout: ParallelLayout, src: SideLayout) -> dict:
    flows = defaultdict(int)
    held = {r: _shard_numel(src, r) for r in src.ranks}
    for group in layout.pp_groups():
        for root in group:
            _chain_broadcast(flows, group, root, held[root])
    for group in layout.tp_groups():  # after the broadcast a rank holds its TP index's shard of every stage
        per_rank = {r: sum(held[x] for x in layout.pp_group(r)) for r in group}
        _ring_allgather(flows, group, per_rank)
    return flows


def flows_gather_within_tp(layout: ParallelLayout, src: SideLayout) -> dict:
    flows = defaultdict(int)
    held = {r: _shard_numel(src, r) for r in src.ranks}
    for group in layout.tp_groups():
        _ring_allgather(flows, group, {r: held[r] for r in group})
    for group in layout.pp_groups():  # full stage tensors = the TP group's shards together
        for root in group:
            _chain_broadcast(flows, group, root, sum(held[x] for x in layout.tp_group(root)))
    return flows


def _gb(n: int) -> str:
    return f"{n / 1e9:9.2f}"


def analytic(cases, bpe: int, ib_gbs: float, nvlink_gbs: float) -> list[dict]:
    rows = []
    for (name, spec), (tp, pp, dp), gpn, vtp in cases:
        layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
        src = megatron_layout(spec, layout, gpn)
        dst = vllm_layout(spec, vtp, layout.world_size, gpn)
        start = time.perf_counter()
        p = plan(src, dst)
        plan_s = time.perf_counter() - start
        full = hf_layout(spec, list(range(layout.world_size)), gpn)
        mins = {"plan": theoretical_minimum(src, dst, bpe), "full": theoretical_minimum(src, full, bpe)}
        schemes = {
            "megarl plan": (flows_of_plan(p), mins["plan"]),
            "gather-everything (verl)": (flows_gather_everything(layout, src), mins["full"]),
            "gather-within-TP (slime)": (flows_gather_within_tp(layout, src), mins["full"]),
        }
        case = f"{name} TP{tp}/PP{pp}/DP{dp} on {layout.world_size // gpn}x{gpn} -> vLLM TP{vtp}"
        stats = {k: summarize(f, bpe, gpn, ib_gbs, nvlink_gbs) for k, (f, _) in schemes.items()}
        for k, (_, m) in schemes.items():
            s = stats[k]
            rows.append(
                {
                    "case": case, "scheme": k, **s, "rank_min": m["rank_min"], "node_min": m["node_min"],
                    "vs_plan_moved": s["moved"] / stats["megarl plan"]["moved"],
                    "vs_plan_cross": s["cross"] / max(1, stats["megarl plan"]["cross"]),
                    "plan_s": plan_s,
                }
            )  # fmt: skip
    return rows


def print_analytic(rows, bpe, ib, nv) -> None:
    print(f"\n## Bytes per sync (analytic, {bpe} bytes/element; est. time: IB {ib} GB/s, NVLink {nv} GB/s per GPU)")
    head = (
        f"{'scheme':26} {'moved GB':>9} {'/min':>6} {'x-node GB':>9} {'/min':>6} {'rank snd':>9} {'rank rcv':>9}"
        f" {'node snd':>9} {'node rcv':>9} {'est s':>7} {'moved/plan':>10} {'x-node/plan':>11}"
    )
    case = None
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            print(f"\n{case}   (plan computed in {r['plan_s']:.2f} s)\n{head}")
        print(
            f"{r['scheme']:26} {_gb(r['moved'])} {r['moved'] / max(1, r['rank_min']):6.3f} {_gb(r['cross'])}"
            f" {r['cross'] / max(1, r['node_min']):6.3f} {_gb(r['rank_send'])} {_gb(r['rank_recv'])}"
            f" {_gb(r['node_send'])} {_gb(r['node_recv'])} {r['est_s']:7.2f} {r['vs_plan_moved']:10.2f}"
            f" {r['vs_plan_cross']:11.2f}"
        )
    print(
        "/min: bytes over the theoretical minimum of what that scheme materialises (plan: the vLLM shards; baselines:"
        " full tensors on every rank); x-node min = bytes a node needs that none of its ranks holds."
    )


# --- measured on gloo ranks -----------------------------------------------------------------------------------------
class _Discard:
    """A transport that drops what it receives (the measurement stops at the destination shards)."""

    name = "discard"

    def __init__(self, dtype):
        self.dtype = dtype

    def load(self, layers) -> None:
        for _ in layers:
            pass


def _megarl_plan(c, verify=True) -> None:
    run_sync(c["sub_plans"], c["tensors"], _Discard(torch.float32), bucket_bytes=64 * 1024**2, verify=verify)


def _gather_everything(c) -> None:
    """Every stage's TP shards broadcast along the PP group, then all-gathered in the TP group (full tensors)."""
    rank, tensors = dist.get_rank(), c["tensors"]
    for owner in c["layout"].pp_group(rank):
        for s in c["src"].ranks[owner]:
            buf = tensors[s.name] if owner == rank else torch.empty(s.shape)
            dist.broadcast(buf, owner, group=c["pp_group"])
            parts = [torch.empty_like(buf) for _ in range(c["layout"].tp)]
            dist.all_gather(parts, buf, group=c["tp_group"])
            torch.cat(parts)


def _gather_within_tp(c) -> None:
    """The own stage all-gathered in the TP group, then the full tensors broadcast along the PP group."""
    rank, tensors, tp = dist.get_rank(), c["tensors"], c["layout"].tp
    full = {}
    for s in c["src"].ranks[rank]:
        parts = [torch.empty_like(tensors[s.name]) for _ in range(tp)]
        dist.all_gather(parts, tensors[s.name], group=c["tp_group"])
        full[s.name] = torch.cat(parts)
    for owner in c["layout"].pp_group(rank):
        for s in c["src"].ranks[owner]:
            buf = full[s.name] if owner == rank else torch.empty((s.shape[0] * tp, *s.shape[1:]))
            dist.broadcast(buf, owner, group=c["pp_group"])


SCHEMES = {
    "megarl plan": _megarl_plan,
    "megarl plan, unverified": lambda c: _megarl_plan(c, verify=False),
    "gather-everything (verl)": _gather_everything,
    "gather-within-TP (slime)": _gather_within_tp,
}


def _measure_worker(cases, repeats: int) -> list[dict]:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for (name, spec), (tp, pp, dp), gpn, vtp in cases:
        layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
        tp_groups = {tuple(g): dist.new_group(g) for g in layout.tp_groups()}
        pp_groups = {tuple(g): dist.new_group(g) for g in layout.pp_groups()}
        src = megatron_layout(spec, layout, gpn)
        gen = torch.Generator().manual_seed(rank)
        ctx = {
            "layout": layout,
            "src": src,
            "tensors": {s.name: torch.randn(s.shape, generator=gen) for s in src.ranks[rank]},
            "sub_plans": split_by_layer(plan(src, vllm_layout(spec, vtp, world, gpn))),
            "tp_group": tp_groups[tuple(layout.tp_group(rank))],
            "pp_group": pp_groups[tuple(layout.pp_group(rank))],
        }
        times = {}
        for label, fn in SCHEMES.items():
            samples = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                fn(ctx)
                dist.barrier()
                samples.append(time.perf_counter() - start)
            times[label] = statistics.median(samples)
        out.append({"case": f"{name} TP{tp}/PP{pp}/DP{dp} -> vLLM TP{vtp} on {world} gloo ranks", "times": times})
    dist.destroy_process_group()
    return out


def print_measured(results) -> None:
    print("\n## Measured sync time on gloo ranks here (fp32, median of repeats; 2 shared cores, so ratios matter)")
    print(f"{'case':58} {'scheme':26} {'seconds':>8} {'/plan':>6} {'/unverified plan':>16}")
    for r in results:
        t0, t1 = r["times"]["megarl plan"], r["times"]["megarl plan, unverified"]
        for k, t in r["times"].items():
            print(f"{r['case']:58} {k:26} {t:8.3f} {t / t0:6.2f} {t / t1:16.2f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes-per-element", type=int, default=2, help="2 = bf16 weights in the engine")
    ap.add_argument("--ib-gbs", type=float, default=25.0, help="InfiniBand GB/s per GPU (HDR 200 Gb/s = 25)")
    ap.add_argument("--nvlink-gbs", type=float, default=150.0, help="NVLink GB/s per GPU, effective (A100: ~150)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-measured", action="store_true")
    args = ap.parse_args(argv)
    rows = analytic(ANALYTIC_CASES, args.bytes_per_element, args.ib_gbs, args.nvlink_gbs)
    print_analytic(rows, args.bytes_per_element, args.ib_gbs, args.nvlink_gbs)
    if not args.skip_measured:
        from megarl.parallel.spawn import run_on_ranks

        print_measured(run_on_ranks(_measure_worker, 4, MEASURED_CASES, args.repeats))


if __name__ == "__main__":
    main()
