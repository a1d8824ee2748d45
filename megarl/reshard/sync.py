"""One weight sync: run a Plan layer by layer and hand each layer's destination tensors to a transport.

Running the plan per layer bounds the staging memory outside the executor to one layer's destination shards (the
transport then writes or streams them into the engine), and verifies each layer before the engine sees it. Every rank
walks the same layer groups in the same order, so the executor's collectives line up.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields

import torch

from megarl.lora import has_lora
from megarl.lora.adapters import merged_weights
from megarl.models.adapter import local_spec_names
from megarl.parallel.comm import WorldComm
from megarl.reshard.executor import comm_device, execute
from megarl.reshard.layout import SideLayout
from megarl.reshard.plan import CROSS_NODE, Plan, Transfer, plan
from megarl.reshard.transport import destination_layout

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _group(name: str) -> tuple[int, int]:
    """Order of a destination tensor's layer group: embeddings first, then layers, then the final norm / head."""
    m = _LAYER.search(name)
    if m:
        return (1, int(m.group(1)))
    return (0, 0) if "embed" in name else (2, 0)


def split_by_layer(p: Plan) -> list[Plan]:
    """The plan cut into one sub-plan per layer group of destination tensors (same cut on every rank).

    A forwarded piece stays in its group: the forwarder's shard and the receiver's shard hold the same HF tensor."""
    transfers: dict[tuple, list[Transfer]] = defaultdict(list)
    padding: dict[tuple, list] = defaultdict(list)
    for t in p.transfers:
        transfers[_group(t.dst_shard)].append(t)
    for pad in p.padding:
        padding[_group(pad[1])].append(pad)
    groups = sorted({_group(n) for shapes in p.dst_shapes.values() for n in shapes})
    return [
        Plan(
            transfers=transfers[g],
            padding=padding[g],
            dst_shapes={r: {n: s for n, s in shapes.items() if _group(n) == g} for r, shapes in p.dst_shapes.items()},
            src_shapes=p.src_shapes,
            gpus_per_node=p.gpus_per_node,
        )
        for g in groups
    ]


class SyncPlans:
    """The per-layer plans of every sync into one set of engines: the engines on ranks ``offset`` ..
    ``offset + world - 1`` (their pool's), fed by the actor at ``src`` (its ranks in the launch). The same on the ranks
    that send and on those that receive, colocated or across pools, so every rank walks the same plans."""

    def __init__(self, spec, src: SideLayout, *, tp: int, world: int, offset: int = 0, lora=None, adapter_src=None):
        """``lora`` and ``adapter_src`` (the actor's adapter factors, ``megatron_adapter_layout``): adapter slots."""
        self.spec, self.src, self.tp, self.world, self.offset, self.lora = spec, src, tp, world, offset, lora
        self._base: dict[str, list[Plan]] = {}
        self.adapters = None if lora is None else split_by_layer(plan(adapter_src, self._dst("lora_slots")))
        """The adapters' plans (slots only)."""

    def _dst(self, transport: str) -> SideLayout:
        gpus_per_node = self.src.gpus_per_node
        dst = destination_layout(transport, self.spec, self.tp, self.world, gpus_per_node, self.lora)
        return dst.shifted(self.offset)

    def base(self, transport: str) -> list[Plan]:
        """The plans of the (whole or base) weights through ``transport``."""
        if transport not in self._base:
            self._base[transport] = split_by_layer(plan(self.src, self._dst(transport)))
        return self._base[transport]


def sends_base(adapter_slots: bool, base_loaded: bool, resend_base: bool) -> bool:
    """Whether a sync moves the (base) weights: always without adapter slots; with them, the first time and when
    asked to (the same decision on the engines' ranks and on the ranks that send to them)."""
    return not adapter_slots or resend_base or not base_loaded


@dataclass
class SyncReport:
    """What one sync did on this rank."""

    transport: str
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    bytes_cross_node: int = 0
    """Bytes this rank sent to ranks of other nodes."""
    peak_buffer_bytes: int = 0
    """The executor's own peak (send + receive buffers of one bucket)."""
    peak_staging_bytes: int = 0
    """The largest layer of destination tensors staged for the transport (outside the executor's budget)."""
    layers: int = 0
    buckets: int = 0

    def __add__(self, other: SyncReport) -> SyncReport:
        """Two syncs run one after the other (the base weights, then the adapters)."""
        peaks = ("peak_buffer_bytes", "peak_staging_bytes")
        merged = {
            f.name: (max if f.name in peaks else sum)((getattr(self, f.name), getattr(other, f.name)))
            for f in fields(self)
            if f.name != "transport"
        }
        return SyncReport(transport=f"{self.transport}+{other.transport}", **merged)


def stream_layers(
    sub_plans: list[Plan],
    src_tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    report: SyncReport,
    *,
    bucket_bytes: int,
    verify: bool,
    compare_full: bool = False,
    on_send: Callable | None = None,
    comm=None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Collective generator: per layer group, this rank's destination tensors, filled and verified.

    Every rank must consume it to the end (the executor's collectives run inside)."""
    comm = comm or WorldComm()
    rank, device = comm.rank, comm_device()
    for sub in sub_plans:
        shapes = sub.dst_shapes.get(rank, {})
        dst = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in shapes.items()}
        stats = execute(
            sub,
            src_tensors,
            dst,
            bucket_bytes=bucket_bytes,
            verify=verify,
            compare_full=compare_full,
            dtype=dtype,
            on_send=on_send,
            comm=comm,
        )
        report.layers += 1
        report.buckets += stats.buckets
        report.bytes_sent += stats.bytes_sent
        report.bytes_received += stats.bytes_received
        report.bytes_local += stats.bytes_local
        element_size = torch.empty((), dtype=dtype).element_size()
        report.bytes_cross_node += element_size * sum(
            t.numel for t in sub.transfers if t.src_rank == rank and sub.link(t) == CROSS_NODE
        )
        report.peak_buffer_bytes = max(report.peak_buffer_bytes, stats.peak_buffer_bytes)
        staged = sum(t.numel() * t.element_size() for t in dst.values())
        report.peak_staging_bytes = max(report.peak_staging_bytes, staged)
        yield dst


def run_sync(
    sub_plans: list[Plan],
    src_tensors: dict[str, torch.Tensor],
    transport,
    *,
    bucket_bytes: int = 512 * 1024**2,
    verify: bool = True,
    compare_full: bool = False,
    on_send: Callable | None = None,
    comm=None,
    dtype: torch.dtype | None = None,
) -> SyncReport:
    """Collective over ``comm`` (default: the default process group): fill the engine behind ``transport`` from
    ``src_tensors`` (this rank's actor parameters). ``transport`` None: this rank holds no engine and only sends
    (a rank of another pool than the engines'); ``dtype`` is then the engines'."""
    report = SyncReport(transport=transport.name if transport is not None else "send")
    start = time.perf_counter()
    layers = stream_layers(
        sub_plans,
        src_tensors,
        transport.dtype if transport is not None else dtype,
        report,
        bucket_bytes=bucket_bytes,
        verify=verify,
        compare_full=compare_full,
        on_send=on_send,
        comm=comm,
    )
    try:
        if transport is None:
            for _ in layers:  # the collectives run as the generator is consumed
                pass
        else:
            transport.load(layers)
    finally:
        layers.close()
    report.seconds = time.perf_counter() - start
    return report


def actor_tensors(model, *, merge_lora: bool = True) -> Mapping[str, torch.Tensor]:
    """The actor's current parameters by Megatron local name (the local spec's names, also for a Transformer Engine
    model: ``megarl.models.adapter.local_spec_name``), read after any pending parameter all-gather.

    ``model`` is a Megatron model chunk or its DistributedDataParallel wrapper. With the distributed optimizer and
    ``overlap_param_gather`` the updated parameters arrive only at the next forward; this forces that gather first.
    With LoRA adapters, ``merge_lora`` gives W + scaling * B A under the base names (an engine without adapter
    slots); otherwise the frozen base and the adapter factors, each under its own name."""
    from megatron.core.distributed import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        if model.ddp_config.use_distributed_optimizer and model.ddp_config.overlap_param_gather:
            model.start_param_sync(force_sync=True)
        model = model.module
    if merge_lora and has_lora(model):  # W + scaling * B A, merged on read (megarl.lora.adapters.MergedWeights)
        return merged_weights(model)
    return local_spec_names((name, p.detach()) for name, p in model.named_parameters())


def push_actor(engine, model, version: int, *, resend_base: bool = False) -> SyncReport:
    """Collective: load the actor's current weights into ``engine`` as ``version`` (the adapters merged into the
    weights unless the engine has adapter slots). ``resend_base``: an engine with adapter slots also gets the base
    again (the first sync of a job). ``model`` None: this rank holds no actor (the rollout pool) and only receives."""
    tensors = {} if model is None else actor_tensors(model, merge_lora=not engine.adapter_slots)
    return engine.update_weights(tensors, version, resend_base=resend_base)
