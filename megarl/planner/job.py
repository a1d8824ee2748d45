"""`megarl plan`: will this job fit, before a GPU is touched? Placement, per-rank memory per phase, a verdict with
the settings that would make it fit, and the weight-sync plan with its estimated time."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config.schema import MegarlConfig
from megarl.config.topology import LaunchError, check_nodes
from megarl.config.validate import (
    adapter_slots,
    divisors,
    layout_config,
    pool_layout_role,
    pools_of,
    rollout_tp,
    vllm_tp_fits,
)
from megarl.models.spec import DTYPE_BYTES, ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.planner.cli import HARDWARE_OPTIONS
from megarl.planner.memory import (
    MiB,
    RankMemory,
    lora_params,
    lora_sync_bytes,
    micro_batch_shape,
    micro_batch_tokens,
    rank_memory,
)
from megarl.planner.step_time import (
    SaveTime,
    StepTime,
    save_time,
    save_time_line,
    signal_lead,
    step_time,
    step_time_lines,
)
from megarl.reshard.layout import hf_layout, megatron_adapter_layout, megatron_layout, peft_adapter_layout, vllm_layout
from megarl.reshard.plan import flows_of_plan, summarize
from megarl.reshard.plan import plan as reshard_plan


class PlanError(ValueError):
    """The layout cannot be placed on the hardware (names the option and the fix)."""


@dataclass(frozen=True)
class Hardware:
    """The cluster the job is planned for."""

    nodes: int
    """Number of nodes."""
    gpus_per_node: int
    """GPUs (ranks) per node."""
    gpu_mem_gb: float = 80.0
    """Memory per GPU in GB (10^9 bytes, as GPUs are sold: an A100-80GB has 80 GB)."""
    ib_gbps: float = 200.0
    """InfiniBand bandwidth per GPU in Gbit/s (HDR: 200)."""
    nvlink_gbps: float = 2400.0
    """NVLink bandwidth per GPU and direction in Gbit/s (A100: 300 GB/s = 2400)."""
    peak_tflops: float = 312.0
    """Dense bf16 peak TFLOP/s per GPU (A100: 312, H100 SXM: 989); the step-time estimate only."""
    hbm_gb_s: float = 2039.0
    """GPU memory bandwidth in GB/s (A100-80GB: 2039, H100 SXM: 3350); the step-time estimate only."""
    mfu: float = 0.4
    """Fraction of the peak FLOP/s that training and prefill reach (the step-time estimate)."""
    decode_bw_efficiency: float = 0.6
    """Fraction of the memory bandwidth that decoding reaches (the step-time estimate)."""
    fs_gb_s: float = 2.0
    """Write bandwidth of the checkpoint filesystem per node in GB/s (the save-time estimate only)."""


def default_hardware(world: int, nodes: int | None, gpus_per_node: int | None, **links) -> Hardware:
    """Fill in the node count or GPUs per node that were not given (8 GPUs per node when the world allows)."""
    if gpus_per_node is None:
        gpus_per_node = world // nodes if nodes else (8 if world % 8 == 0 else world)
    if nodes is None:
        nodes = -(-world // gpus_per_node)
    return Hardware(nodes, gpus_per_node, **{k: v for k, v in links.items() if v is not None})


def plan_for(cfg: MegarlConfig, spec: ModelSpec, options=None, sync: bool = True) -> JobPlan:
    """The plan of ``cfg`` on the hardware ``options`` names (`megarl plan`'s hardware options as attributes:
    ``nodes``, ``gpus_per_node``, ``gpu_mem_gb``, ...; defaults for what it does not name; None: all defaults)."""
    par = cfg.actor.parallel
    given = {name: getattr(options, name, None) for name in HARDWARE_OPTIONS}
    hw = default_hardware(par.tp * par.pp * par.dp, given.pop("nodes"), given.pop("gpus_per_node"), **given)
    return make_plan(cfg, spec, hw, sync=sync)


@dataclass
class JobPlan:
    cfg: MegarlConfig
    spec: ModelSpec
    layout: ParallelLayout
    hw: Hardware
    ranks: list[RankMemory]
    sync: dict
    """Weight-sync statistics of the resharding engine's plan (bytes by link, busiest rank/node, est_s)."""
    step: StepTime | None = None
    """The step-time estimate (with the sync plan)."""
    save: SaveTime | None = None
    """The training checkpoint's size and save-time estimate."""

    @property
    def capacity(self) -> int:
        return int(self.hw.gpu_mem_gb * 1e9)

    def worst(self) -> tuple[RankMemory, str, int]:
        """The rank and phase with the highest peak."""
        m = max(self.ranks, key=lambda r: (r.peak()[1], -r.rank))
        phase, peak = m.peak()
        return m, phase, peak

    @property
    def fits(self) -> bool:
        return self.worst()[2] <= self.capacity


def make_plan(cfg: MegarlConfig, spec: ModelSpec, hw: Hardware, *, sync: bool = True) -> JobPlan:
    """Collective-free and GPU-free: everything is computed from shapes. ``sync=False`` skips the weight-sync
    plan (memory only)."""
    try:  # the launchers' own check: the job is planned on the nodes it will be launched on
        check_nodes(cfg, hw.nodes, hw.gpus_per_node, "--nodes", "--gpus-per-node")
    except LaunchError as e:
        raise PlanError(str(e)) from None
    par = cfg.actor.parallel
    layout = ParallelLayout.of(par, hw.gpus_per_node)
    gpn = hw.gpus_per_node
    stats = {}
    pools = pools_of(cfg)  # the actor's ranks send to the rollout pool's (colocated: the same ranks)
    actor_at = next((p.ranks for p in pools if "actor" in p.roles), range(layout.world_size))
    engines_at = next((p.ranks for p in pools if "rollout" in p.roles), range(layout.world_size))
    if sync:
        src = megatron_layout(spec, layout, gpn).shifted(actor_at.start)
        if cfg.rollout.backend == "vllm":
            dst = vllm_layout(spec, rollout_tp(cfg), len(engines_at), gpn).shifted(engines_at.start)
        else:
            dst = hf_layout(spec, list(range(layout.world_size)), gpn)
        bpe, links = DTYPE_BYTES[cfg.model.dtype], (gpn, hw.ib_gbps / 8, hw.nvlink_gbps / 8)

        def stats_of(p) -> dict:
            written = max(sum(math.prod(shape) for shape in shapes.values()) for shapes in p.dst_shapes.values())
            return {**summarize(flows_of_plan(p), bpe, *links), "written": written * bpe}

        stats = stats_of(reshard_plan(src, dst))
        if adapter_slots(cfg):  # every sync after the first: full adapter factors on every engine rank
            lora, ranks = cfg.actor.lora, list(range(len(engines_at)))
            src = megatron_adapter_layout(spec, lora, layout, gpn).shifted(actor_at.start)
            dst = peft_adapter_layout(spec, lora, ranks, gpn).shifted(engines_at.start)
            stats["adapters"] = stats_of(reshard_plan(src, dst))
    step = step_time(cfg, spec, hw, stats["est_s"]) if stats else None
    ranks = rank_memory(cfg, spec, layout, gpn, gpu_bytes=int(hw.gpu_mem_gb * 1e9))
    return JobPlan(cfg, spec, layout, hw, ranks, stats, step, save_time(cfg, spec, hw))


# --- what would make it fit ----------------------------------------------------------------------------------------
def candidate_changes(cfg: MegarlConfig, spec: ModelSpec, hw: Hardware) -> list[tuple[str, list[str]]]:
    """Settings that lower a peak, each as (description, overrides), in the order they are usually tried."""
    out = []
    par = cfg.actor.parallel
    opt_off = [m for m in ("actor", "critic") if not getattr(cfg, m).optim.use_distributed_optimizer]
    if par.dp > 1 and opt_off:
        out.append(("distributed optimizer", [f"{m}.optim.use_distributed_optimizer=true" for m in opt_off]))
    if cfg.offload.enable == "false":
        out.append(("offload during generation", ["offload.enable=true"]))
    tp = rollout_tp(cfg)
    world = par.tp * par.pp * par.dp
    bigger = [d for d in divisors(world) if tp < d <= hw.gpus_per_node and vllm_tp_fits(spec, d)]
    if cfg.rollout.backend == "vllm" and bigger:
        out.append((f"rollout TP {bigger[0]}", [f"rollout.tp={bigger[0]}"]))
    if not cfg.model.recompute:
        out.append(("activation recompute", ["model.recompute=true"]))
    tokens = micro_batch_tokens(cfg)
    if tokens >= 2 * cfg.actor.seq_length:
        out.append((f"micro-batch of {tokens // 2} tokens", [f"actor.max_tokens_per_micro_batch={tokens // 2}"]))
    return out


def apply(cfg: MegarlConfig, overrides: list[str]) -> MegarlConfig:
    """A copy of ``cfg`` with dotted overrides (values as YAML scalars)."""
    import copy

    import yaml

    cfg = copy.deepcopy(cfg)
    for item in overrides:
        key, value = item.split("=", 1)
        *path, last = key.split(".")
        node = cfg
        for p in path:
            node = getattr(node, p)
        setattr(node, last, yaml.safe_load(value))
        if hasattr(node, "__post_init__"):
            node.__post_init__()
    return cfg


def suggestions(job: JobPlan) -> list[tuple[str, list[str], int, bool]]:
    """Each candidate change alone, then the candidates added one by one until the job fits (if it then does):
    (description, overrides, new peak, fits)."""
    out, together, names = [], [], []
    for desc, overrides in candidate_changes(job.cfg, job.spec, job.hw):
        new = make_plan(apply(job.cfg, overrides), job.spec, job.hw, sync=False)
        out.append((desc, overrides, new.worst()[2], new.fits))
    if any(fits for *_, fits in out):
        return out
    for desc, overrides, *_ in out:
        together, names = together + overrides, names + [desc]
        new = make_plan(apply(job.cfg, together), job.spec, job.hw, sync=False)
        if len(names) > 1 and (new.fits or len(names) == len(out)):
            out.append((" + ".join(names), together, new.worst()[2], new.fits))
            break
    return out


# --- report --------------------------------------------------------------------------------------------------------
def _sync_lines(s: dict, size, unit: str) -> list[str]:
    return [
        f"into each engine rank {size(s['written'])} {unit} (local copies included); "
        f"moved {size(s['moved'])} {unit} ({size(s['moved'] - s['cross'])} same node, {size(s['cross'])} across "
        f"nodes); busiest rank sends {size(s['rank_send'])} / receives {size(s['rank_recv'])} {unit}; busiest node "
        f"sends {size(s['node_send'])} / receives {size(s['node_recv'])} {unit} across nodes; estimated sync time "
        f"{s['est_s']:.3f} s"
    ]


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}"


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def placement_lines(layout: ParallelLayout, cfg: MegarlConfig | None = None) -> list[str]:
    """Rank -> node map with (tp, pp, dp) coordinates, one line per node; with pools, one line per pool first with
    its layout (the actor's coordinates below are then counted from its pool's first rank)."""
    lines = []
    for p in pools_of(cfg) if cfg is not None else []:
        role = pool_layout_role(p)
        if role is None:
            where = f"engines of TP={rollout_tp(cfg)}"
        else:
            par = layout_config(cfg, role)
            where = f"Megatron TP={par.tp} PP={par.pp} DP={par.dp}"
        lines.append(f"pool {p.name}: ranks {_ranges(list(p.ranks))}, roles {', '.join(p.roles)}; {where}")
    lines += [f"rank = tp + {layout.tp} * (dp + {layout.dp} * pp)   (TP innermost: a TP group is consecutive ranks)"]
    for node in range(layout.num_nodes):
        ranks = layout.node_ranks(node)
        coords = [layout.coords(r) for r in ranks]
        span = {a: _ranges(sorted({getattr(c, a) for c in coords})) for a in ("tp", "pp", "dp")}
        lines.append(f"node {node}: ranks {_ranges(ranks)}  tp {span['tp']}  pp {span['pp']}  dp {span['dp']}")
    return lines


def format_plan(job: JobPlan, with_suggestions: bool = True) -> str:
    """The report `megarl plan` prints: placement, memory per rank, verdict, host memory, weight sync, step time,
    LoRA."""
    hw, layout, cfg = job.hw, job.layout, job.cfg
    lines = [
        f"megarl plan: {job.spec.family} {job.spec.num_layers}x{job.spec.hidden_size} ({cfg.model.dtype}), "
        f"{cfg.algorithm.adv_estimator}, actor {layout}, rollout {cfg.rollout.backend} TP={rollout_tp(cfg)}",
        f"hardware: {hw.nodes} nodes x {hw.gpus_per_node} GPUs x {hw.gpu_mem_gb:g} GB, IB {hw.ib_gbps:g} Gb/s, "
        f"NVLink {hw.nvlink_gbps:g} Gb/s per GPU",
        "",
        "## Placement",
        *placement_lines(layout, cfg),
        "",
        f"## Memory per rank (GB; offload {'on' if job.ranks[0].offloaded else 'off'})",
    ]
    lines += _memory_table(job)
    lines += ["", "## Verdict", *_verdict_lines(job, with_suggestions)]
    lines += host_memory_lines(job)
    if job.sync:
        lines += _weight_sync_lines(job)
    if job.step is not None:
        lines += ["", "## Step time (estimate)"]
        lines += step_time_lines(job.step, hw, one_step_off=any("rollout" in p.roles for p in pools_of(cfg)))
    if job.save is not None:
        lines += [save_time_line(job.save, hw)]
        if job.step is not None:
            lines += [f"SLURM signal lead: {signal_lead(cfg, job.step, job.save)[1]}"]
    if cfg.actor.lora is not None:
        lines += _lora_lines(job)
    mb = micro_batch_shape(cfg.actor, cfg.actor.seq_length)
    lines += [
        "",
        "Exact: parameters, gradient buffers, optimizer state, vLLM weights, reshard buckets. Accounted: activations, "
        f"tensor by tensor as the model saves them (megarl/planner/activations.py; the largest micro-batch the "
        f"packer can form: {mb.tokens} tokens in sequences of up to {mb.length}; packing by length keeps every "
        "micro-batch within the budget, so the peak is the same for any lengths). Estimates: the logits around the "
        "loss, the configured KV cache, a 2 GiB reserve for CUDA context/NCCL/allocator.",
    ]
    return "\n".join(lines)


def _verdict_lines(job: JobPlan, with_suggestions: bool) -> list[str]:
    """FITS with the peak and what is spare, or DOES NOT FIT with the largest consumers and the settings that would
    make it fit."""
    hw = job.hw
    m, phase, peak = job.worst()
    if job.fits:
        return [f"FITS: peak {_gb(peak)} GB of {hw.gpu_mem_gb:g} GB on rank {m.rank} during {phase} "
                f"({_gb(job.capacity - peak)} GB to spare)"]  # fmt: skip
    top = sorted(m.phases[phase], key=lambda c: -m.consumers[c])[:3]
    lines = [
        f"DOES NOT FIT: rank {m.rank} needs {_gb(peak)} GB during {phase}, {_gb(peak - job.capacity)} GB over "
        f"{hw.gpu_mem_gb:g} GB; largest: " + ", ".join(f"{c} {_gb(m.consumers[c])}" for c in top)
    ]
    if with_suggestions:
        for desc, overrides, new_peak, fits in suggestions(job):
            lines.append(
                f"  {'would fit' if fits else 'still over'} with {desc} ({' '.join(overrides)}): peak "
                f"{_gb(new_peak)} GB"
            )
    return lines


def _weight_sync_lines(job: JobPlan) -> list[str]:
    """The resharding plan's bytes and estimated times (with LoRA: the first sync's and every later one's)."""
    s, hw, cfg = job.sync, job.hw, job.cfg
    lines = ["", f"## Weight sync (resharding plan, actor {job.layout} -> {cfg.rollout.backend} TP={rollout_tp(cfg)})"]
    if "adapters" in s:
        lines += ["the first sync (the base weights):"]
    lines += _sync_lines(s, _gb, "GB")
    if "adapters" in s:
        lines += ["every later sync (the LoRA adapters into vLLM's LoRA slots, full factors on every engine rank):"]
        lines += _sync_lines(s["adapters"], lambda n: f"{n / MiB:.1f}", "MiB")
    lines += [
        f"estimated times: NVLink {hw.nvlink_gbps / 8:g} GB/s, IB {hw.ib_gbps / 8:g} GB/s per GPU, no latency or "
        "verification"
    ]
    return lines


def _lora_lines(job: JobPlan) -> list[str]:
    """The adapters: trainable parameters on rank 0 and the bytes a sync sends per engine rank."""
    cfg, lora = job.cfg, job.cfg.actor.lora
    trainable = sum(p.numel for p in lora_params(job.spec, job.layout, lora)[0])
    return [
        "",
        f"## LoRA (rank {lora.rank}, alpha {lora.effective_alpha:g}, {', '.join(lora.target_modules)})",
        f"trainable on rank 0: {trainable:,} adapter parameters (gradients and optimizer state on these only); "
        "the frozen base in the model dtype; the reference is the base (no second copy)",
        f"adapter bytes per engine rank: {lora_sync_bytes(job.spec, lora, cfg.model.dtype) / MiB:.1f} MiB ("
        + ("synced alone after the first sync: the weight-sync section)" if adapter_slots(cfg) else
           "rollout.lora_merge: every sync sends the merged whole weights instead)"),
    ]


def host_memory_per_node(job: JobPlan) -> list[dict[str, int]]:
    """Per node, the host memory the job pins: the offloaded training state (``offload.*``: exact-size pinned copies,
    ``megarl.backend.offload.host_buffer``) and, with LoRA adapter slots, vLLM's base weights while it sleeps at
    level 1 (vLLM's own pinned copies)."""
    gpn, out = job.hw.gpus_per_node, []
    for node in range(job.hw.nodes):
        ranks = [m for m in job.ranks if m.rank // gpn == node]
        sleeping = sum(m.consumers.get("vLLM weights", 0) for m in ranks) if adapter_slots(job.cfg) else 0
        out.append({"offloaded training state": sum(sum(m.offloaded.values()) for m in ranks),
                    "vLLM weights while asleep": sleeping})  # fmt: skip
    return out


def host_memory_lines(job: JobPlan) -> list[str]:
    nodes = host_memory_per_node(job)
    top = max(nodes, key=lambda n: sum(n.values()))
    if not sum(top.values()):
        return ["host memory (pinned) per node: none (nothing is offloaded, vLLM drops its weights when it sleeps)"]
    parts = ", ".join(f"{k} {_gb(v)}" for k, v in top.items() if v)
    return [f"host memory (pinned) per node: up to {_gb(sum(top.values()))} GB ({parts})"]


def _memory_table(job: JobPlan) -> list[str]:
    """One column per distinct memory profile (ranks with identical numbers are merged), one row per consumer."""
    profiles: dict[tuple, list[int]] = {}
    for m in job.ranks:
        key = (m.pool,) + tuple(sorted(m.consumers.items())) + tuple(sorted(m.offloaded))
        profiles.setdefault(key, []).append(m.rank)
    reps = [job.ranks[ranks[0]] for ranks in profiles.values()]
    heads = [f"{job.ranks[r[0]].pool} {_ranges(r)}".strip() if job.ranks[r[0]].pool else f"ranks {_ranges(r)}"
             for r in profiles.values()]  # fmt: skip
    width = max(12, *(len(h) for h in heads)) + 1
    name_w = max(len(c) for c in reps[0].consumers) + 14
    rows = [f"{'':{name_w}}" + "".join(f"{h:>{width}}" for h in heads)]
    for c in reps[0].consumers:
        label = c + (" [offloaded]" if c in reps[0].offloaded else "")
        rows.append(f"{label:{name_w}}" + "".join(f"{_gb(m.consumers[c]):>{width}}" for m in reps))
    for part in reps[0].parts:  # shares of the lines above (counted there)
        rows.append(f"{'  ' + part:{name_w}}" + "".join(f"{_gb(m.parts[part]):>{width}}" for m in reps))
    for phase in reps[0].phases:
        label = f"= {phase} peak"
        rows.append(f"{label:{name_w}}" + "".join(f"{_gb(m.phase_bytes(phase)):>{width}}" for m in reps))
    return rows


def verdict_line(job: JobPlan) -> str:
    m, phase, peak = job.worst()
    word = "fits" if job.fits else "DOES NOT FIT"
    return (
        f"memory plan: {word} on {job.hw.nodes}x{job.hw.gpus_per_node} GPUs of {job.hw.gpu_mem_gb:g} GB (peak "
        f"{_gb(peak)} GB on rank {m.rank} during {phase}); details: megarl plan"
    )

