"""GPU memory of every rank of an RL job, per phase, computed from shapes before anything is launched.

Exact parts (equal, byte for byte, to what a run allocates; ``tests/test_plan.py`` compares them with real models):
parameter counts per rank come from the resharding engine's shape-only layout descriptions
(``megarl.reshard.layout``), and Megatron's DDP gradient buffer and distributed-optimizer shards are laid out by the
same rules as ``megatron/core/distributed/param_and_grad_buffer.py`` (megatron-core 0.16): one buffer per model chunk
(``overlap_grad_reduce`` is off, so no bucket size), with the distributed optimizer every parameter starts at a
multiple of 64 elements, a tied embedding gets a bucket of its own, and every bucket is padded to a multiple of
lcm(DP, 128) and split evenly over the DP ranks. Gradients are reduced in fp32 (megarl's DDP setting).
Adam's per-parameter ``step`` counters live on the host (torch Adam without ``capturable``) and are not counted.

Accounted: activations, tensor by tensor as the model saves them for backward (``megarl.planner.activations``; within
15% of what autograd really holds, counted on CPU in ``tests/test_plan_activations.py``). Estimates (labelled as such
wherever they are printed): the logits' transient copies around the loss, the KV cache (``rollout.kv_cache_mb``) and a
fixed per-GPU reserve for the CUDA context, NCCL and allocator slack.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from megarl.backend.offload import ACTOR_GRADS, ACTOR_OPTIMIZER, CRITIC, REFERENCE, REWARD_MODEL, flagged_groups
from megarl.config.device_defaults import kv_cache_bytes
from megarl.config.recipe import needs_critic, needs_reference, needs_reward_model, reward_model_spec
from megarl.config.schema import MegarlConfig
from megarl.config.validate import layout_config, pool_layout_role, pools_of, rollout_tp
from megarl.lora.adapters import hf_shape
from megarl.models.spec import DTYPE_BYTES, ModelSpec
from megarl.parallel import megatron_shards as ms
from megarl.parallel.layout import ParallelLayout, Pool
from megarl.planner.activations import Kernels, MicroBatchShape, Model, logits_transient_bytes, stage_activation_bytes
from megarl.reshard.layout import hf_layout, megatron_adapter_layout, megatron_layout, vllm_layout

GiB = 1024**3
MiB = 1024**2
GRAD_BYTES = 4  # megarl's DDP reduces gradients in fp32 (grad_reduce_in_fp32=True)
RESERVE_BYTES = 2 * GiB
"""Estimate: CUDA context, NCCL communicators and caching-allocator slack per GPU."""
_ENGINE_LAYER = re.compile(r"^model\.layers\.(\d+)\.")  # vLLM / HF names
_EMBED, _OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
_LAYER_ORDER = (
    "input_layernorm.weight",
    "self_attention.linear_proj.weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight",
    "self_attention.k_layernorm.weight",
    "pre_mlp_layernorm.weight",
    "mlp.router.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)
_EXPERT_PARAM = re.compile(r"\.mlp\.experts\.local_experts\.")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")


@dataclass(frozen=True)
class Param:
    """One Megatron parameter on one rank."""

    name: str
    numel: int
    shared_embedding: bool = False
    """Megatron's ``shared_embedding`` flag (tied embeddings with PP > 1): a DDP bucket of its own."""


def _module_order(name: str) -> tuple:
    """Position in GPTModel.named_parameters() (local spec), which fixes where each parameter sits in the buffer."""
    if name == _EMBED:
        return (0,)
    m = ms._LAYER.match(name)
    if m:
        expert = _EXPERT.match(m.group(2))  # a routed layer: its router, then expert by expert fc1 and fc2
        where = (_LAYER_ORDER.index("mlp.router.weight"), int(expert[1]), int(expert[2])) if expert else ()
        return (1, int(m.group(1)), where or (_LAYER_ORDER.index(m.group(2)),))
    if name == "decoder.final_layernorm.weight":
        return (2,)
    return (3, name.endswith(".bias"))


def model_params(spec: ModelSpec, layout: ParallelLayout, *, value_head: bool = False) -> dict[int, list[Param]]:
    """Every rank's Megatron parameters, in module order. ``value_head``: the critic (its output layer is a
    replicated hidden -> 1 head with a bias, and it never ties embeddings); a reward model (``spec.score_head``) has
    the same head without the bias."""
    side = megatron_layout(spec, layout, gpus_per_node=layout.world_size)
    scalar = value_head or spec.score_head
    tied_pp = spec.tie_word_embeddings and layout.pp > 1 and not scalar
    out = {}
    for rank, shards in side.ranks.items():
        params = [
            Param(s.name, math.prod(s.shape), tied_pp and s.name in (_EMBED, _OUTPUT))
            for s in shards
            if not (scalar and s.name == _OUTPUT)
        ]
        if scalar and layout.coords(rank).pp == layout.pp - 1:
            params += [Param(_OUTPUT, spec.hidden_size)]
            params += [] if spec.score_head else [Param("output_layer.bias", 1)]
        out[rank] = sorted(params, key=lambda p: _module_order(p.name))
    return out


def expert_numel(params: list[Param]) -> int:
    """Elements of the routed experts' parameters among ``params`` (Megatron's ``mlp.experts.local_experts``)."""
    return sum(p.numel for p in params if _EXPERT_PARAM.search(p.name))


def lora_params(spec: ModelSpec, layout: ParallelLayout, lora) -> dict[int, list[Param]]:
    """Every rank's adapter parameters (the only trainable ones with ``actor.lora``), in module order: the layout
    description's (``megatron_adapter_layout``: per layer of its stage, each linear's A factors then its B factors)."""
    side = megatron_adapter_layout(spec, lora, layout, gpus_per_node=layout.world_size)
    return {rank: [Param(s.name, math.prod(s.shape)) for s in shards] for rank, shards in side.ranks.items()}


def lora_sync_bytes(spec: ModelSpec, lora, dtype: str) -> int:
    """Bytes of all adapters in the model dtype: what an adapter-only weight sync would move into one engine (the
    sync today sends the merged weights)."""
    per_layer = sum(lora.rank * sum(hf_shape(spec, t)) for t in lora.target_modules)
    return spec.num_layers * per_layer * DTYPE_BYTES[dtype]


@dataclass
class GradBuffer:
    """Megatron DDP's contiguous gradient (and, with the distributed optimizer, parameter) buffer of one rank."""

    numel: int
    """Elements including padding."""
    ranges: dict[str, tuple[int, int]]
    """Each parameter's [start, end) in the buffer."""
    buckets: list[tuple[int, int]]
    """[start, end) of each bucket (padded)."""

    def shard_numel(self, dp_rank: int, dp: int) -> int:
        """Parameter elements (padding excluded) of this DP rank's distributed-optimizer shard."""
        total = 0
        for b0, b1 in self.buckets:
            per = (b1 - b0) // dp
            lo, hi = b0 + dp_rank * per, b0 + (dp_rank + 1) * per
            total += sum(max(0, min(hi, e) - max(lo, s)) for s, e in self.ranges.values())
        return total


def grad_buffer(params: list[Param], dp: int, distributed_optimizer: bool) -> GradBuffer:
    """The buffer Megatron builds for ``params`` (module order; it fills the buffer in reverse)."""

    def pad(n: int, to: int) -> int:
        return -(-n // to) * to

    ranges, buckets = {}, []
    start = bucket_start = 0
    in_bucket = 0

    def close(end: int) -> int:
        nonlocal bucket_start, in_bucket
        end = pad(end, math.lcm(dp, 128)) if distributed_optimizer else end
        buckets.append((bucket_start, end))
        bucket_start, in_bucket = end, 0
        return end

    end = 0
    for p in reversed(params):
        if distributed_optimizer:
            start = pad(start, 64)
        own_bucket = p.shared_embedding and distributed_optimizer
        if own_bucket and in_bucket:
            start = close(start)
        end = start + p.numel
        ranges[p.name] = (start, end)
        in_bucket += 1
        start = close(end) if own_bucket else end
    if in_bucket:
        close(end)
    return GradBuffer(buckets[-1][1] if buckets else 0, ranges, buckets)


@dataclass
class ModelBytes:
    """One Megatron model on one rank."""

    params: int
    grads: int = 0
    optimizer: int = 0
    """Adam moments (or SGD momentum) and fp32 main parameters of a bf16/fp16 model."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def trained_model_bytes(params: list[Param], dtype: str, optim, dp_rank: int, dp: int, ep: int = 1) -> ModelBytes:
    """Parameters, gradient buffer and optimizer state of a model trained with ``optim`` (an OptimConfig).
    Megatron's DDP keeps routed experts in a buffer of their own (at every EP: ``experts_in_their_own_buffer``),
    reduced (and with the distributed optimizer sharded) over the expert-data-parallel group: ``dp / ep`` ranks,
    this one at ``dp_rank // ep``."""
    experts = [p for p in params if _EXPERT_PARAM.search(p.name)]
    dense = [p for p in params if not _EXPERT_PARAM.search(p.name)]
    a = _one_buffer_bytes(dense, dtype, optim, dp_rank, dp)
    if not experts:
        return a
    b = _one_buffer_bytes(experts, dtype, optim, dp_rank // ep, dp // ep)
    return ModelBytes(a.params + b.params, a.grads + b.grads, a.optimizer + b.optimizer)


def _one_buffer_bytes(params: list[Param], dtype: str, optim, dp_rank: int, dp: int) -> ModelBytes:
    """``trained_model_bytes`` of parameters that share one DDP buffer over ``dp`` ranks."""
    distopt = optim.use_distributed_optimizer
    buf = grad_buffer(params, dp, distopt)
    # with the distributed optimizer the parameters are re-homed into a padded buffer of their dtype
    param_numel = buf.numel if distopt else sum(p.numel for p in params)
    state_numel = buf.shard_numel(dp_rank, dp) if distopt else sum(p.numel for p in params)
    moments = {"adam": 2, "sgd": 1 if optim.sgd_momentum else 0}[optim.optimizer]
    main = 1 if DTYPE_BYTES[dtype] < 4 else 0  # fp32 models: the optimizer steps the parameters themselves
    return ModelBytes(param_numel * DTYPE_BYTES[dtype], buf.numel * GRAD_BYTES, 4 * (moments + main) * state_numel)


def activation_bytes(
    cfg: MegarlConfig, spec: ModelSpec, layout: ParallelLayout, pp_rank: int, *, critic: bool = False
) -> int:
    """Bytes one pipeline stage saves for backward during the actor's (``critic``: the critic's) update, at its
    largest micro-batch (``micro_batch_shape``), as ``megarl.planner.activations`` accounts them tensor by tensor: up to
    PP - stage micro-batches in flight (1F1B), ``model.recompute`` keeping one input per layer."""
    role = cfg.critic if critic else cfg.actor
    balancing = not critic and spec.is_moe and cfg.actor.moe_aux_loss_coef > 0
    model = replace(activation_model(cfg, spec, layout), load_balancing=balancing)
    per_stage = spec.num_layers // layout.pp
    return stage_activation_bytes(
        model,
        micro_batch_shape(role, cfg.actor.seq_length),
        layers=per_stage,
        routed=sum(spec.moe_layers[pp_rank * per_stage : (pp_rank + 1) * per_stage]),
        first=pp_rank == 0,
        last=pp_rank == layout.pp - 1,
        in_flight=layout.pp - pp_rank,
        recompute=cfg.model.recompute,
        value_head=critic,
        entropy_bonus=not critic and cfg.actor.entropy_coeff != 0,
    )


def logits_bytes(cfg: MegarlConfig, spec: ModelSpec, layout: ParallelLayout, pp_rank: int) -> int:
    """The actor's logits around its loss on the last stage (not saved for backward: ``logits_transient_bytes``)."""
    if pp_rank != layout.pp - 1:
        return 0
    shape = micro_batch_shape(cfg.actor, cfg.actor.seq_length)
    return logits_transient_bytes(activation_model(cfg, spec, layout), shape)


def activation_model(cfg: MegarlConfig, spec: ModelSpec, layout: ParallelLayout) -> Model:
    """The model as the activation accounting sees it: dtype, TP, and which kernels save what."""
    local = cfg.model.transformer_impl == "local"
    kernels = Kernels(cfg.model.attention if local else "sdpa", megatron_glu=not local)
    return Model(spec, DTYPE_BYTES[cfg.model.dtype], layout.tp, kernels)


def micro_batch_shape(role, seq_length: int) -> MicroBatchShape:
    """The largest micro-batch ``role`` (the actor's or critic's config) can form (``megarl.backend.batch``): its
    token budget filled, with sequences of up to ``seq_length`` (a sequence longer than the budget gets a
    micro-batch of its own), or ``micro_batch_size`` sequences of ``seq_length``."""
    budget = role.max_tokens_per_micro_batch
    if not budget:
        return MicroBatchShape(role.micro_batch_size * seq_length, seq_length)
    return MicroBatchShape(max(budget, seq_length), seq_length)


def micro_batch_tokens(cfg: MegarlConfig) -> int:
    """Tokens in the actor's largest training micro-batch."""
    return micro_batch_shape(cfg.actor, cfg.actor.seq_length).tokens


@dataclass
class RankMemory:
    """Bytes on one rank, by consumer; ``phases`` say which consumers are resident in each phase."""

    rank: int
    pool: str = ""
    """Its pool's name ("" when colocated)."""
    consumers: dict[str, int] = field(default_factory=dict)
    offloaded: dict[str, int] = field(default_factory=dict)
    """Consumers moved to host memory while vLLM generates (and what that frees)."""
    phases: dict[str, list[str]] = field(default_factory=dict)
    parts: dict[str, int] = field(default_factory=dict)
    """Shares of consumers shown on lines of their own (already counted in their consumer, in no phase): the
    routed experts' parameters and gradients of an MoE actor."""

    def phase_bytes(self, phase: str) -> int:
        return sum(self.consumers[c] for c in self.phases[phase])

    def peak(self) -> tuple[str, int]:
        return max(((p, self.phase_bytes(p)) for p in self.phases), key=lambda x: x[1])


STARTUP, GENERATION, SYNC, TRAINING = "start-up", "generation", "weight sync", "training"
ACTIVATIONS, LOGITS = "activations (saved for backward)", "logits around the loss (estimate)"


def rank_memory(
    cfg: MegarlConfig, spec: ModelSpec, layout: ParallelLayout, gpus_per_node: int, gpu_bytes: int = 80 * 10**9
) -> list[RankMemory]:
    """Every rank's consumers and phases. Colocated (GPU): vLLM sleeps while Megatron trains, freeing all of it (at
    level 2, or at level 1 with LoRA adapter slots, its weights then waiting in host memory), and the ``offload.*``
    state leaves for generation. With pools (``placement.pools``) each rank holds its pool's roles only, its Megatron
    models at its pool's layout (the actor's, else the critic's), and nothing sleeps or moves: every phase holds all
    of its own state. ``gpu_bytes``: one GPU's memory (``rollout.kv_cache_mb: auto`` sizes the KV cache from it).
    """
    pools = pools_of(cfg)
    if not pools:  # colocated: one pool of every role at the actor's layout
        pools = [Pool("all", range(layout.world_size), ("actor", "critic", "reference", "rollout", "reward_model"))]
    job = _JobMemory(cfg, spec, layout, gpus_per_node, gpu_bytes, pools)
    return [job.rank(pool, rank) for pool in pools for rank in pool.ranks]


class _JobMemory:
    """What ``rank_memory`` works out once for the whole job (layouts, the engines' shards, LoRA adapters, the
    offloaded groups) and then per rank."""

    def __init__(self, cfg: MegarlConfig, spec: ModelSpec, layout: ParallelLayout, gpus_per_node: int,
                 gpu_bytes: int, pools: list) -> None:  # fmt: skip

        self.cfg, self.spec, self.gpu_bytes, self.dtype = cfg, spec, gpu_bytes, cfg.model.dtype
        self.layouts = {"actor": layout}
        for role in ("critic", "reward_model"):
            par = layout_config(cfg, role)
            self.layouts[role] = ParallelLayout.of(par, gpus_per_node)
        self.rm_spec = reward_model_spec(cfg)[1] if needs_reward_model(cfg) else None
        self.params = {}
        """(layout role, value head) -> per-rank parameters, computed once."""
        self.engines = next(p for p in pools if "rollout" in p.roles)
        if cfg.rollout.backend == "vllm":
            self.engine = vllm_layout(spec, rollout_tp(cfg), self.engines.size, gpus_per_node)
        else:
            self.engine = hf_layout(spec, list(range(self.engines.size)), gpus_per_node)
        self.engine_key = "vLLM weights" if cfg.rollout.backend == "vllm" else "HF engine weights"
        self.shared = len(pools) == 1
        self.offloaded = flagged_groups(cfg.offload) if cfg.offload.active(on_gpu=True) and self.shared else []  # GPUs
        self.adapters = lora_params(spec, layout, cfg.actor.lora) if cfg.actor.lora is not None else None

    def params_of(self, role: str, value_head: bool = False):
        if (role, value_head) not in self.params:
            self.params[(role, value_head)] = model_params(self.spec, self.layouts[role], value_head=value_head)
        return self.params[(role, value_head)]

    def rank(self, pool, rank: int) -> RankMemory:
        layout_of = pool_layout_role(pool)
        lay = self.layouts[layout_of] if layout_of else None
        m = RankMemory(rank, pool=pool.name if not self.shared else "")
        self._models(m, pool, layout_of, lay)
        self._engine(m, pool, rank)
        trains = "actor" if "actor" in pool.roles else "critic" if "critic" in pool.roles else None
        c = lay.coords(pool.local(rank)) if lay else None
        saved = activation_bytes(self.cfg, self.spec, lay, c.pp, critic=trains == "critic") if lay and trains else 0
        m.consumers[ACTIVATIONS] = saved
        m.consumers[LOGITS] = logits_bytes(self.cfg, self.spec, lay, c.pp) if lay and trains == "actor" else 0
        m.consumers["reserve (estimate)"] = RESERVE_BYTES
        self._phases(m)
        return m

    def _models(self, m: RankMemory, pool, layout_of: str | None, lay: ParallelLayout | None) -> None:
        """The Megatron models' parameters, gradients and optimizer states this rank holds."""
        cfg, dtype = self.cfg, self.dtype
        local = pool.local(m.rank)
        c = lay.coords(local) if lay else None
        actor = ModelBytes(0)
        if "actor" in pool.roles and self.adapters is not None:  # LoRA: the frozen base has no gradients or
            # optimizer; the adapters are fp32 in every model dtype (their optimizer steps them, no main copy)
            actor = trained_model_bytes(self.adapters[local], "float32", cfg.actor.optim, c.dp, lay.dp)  # no experts
            actor.params += sum(p.numel for p in self.params_of("actor")[local]) * DTYPE_BYTES[dtype]
        elif "actor" in pool.roles:
            actor = trained_model_bytes(self.params_of("actor")[local], dtype, cfg.actor.optim, c.dp, lay.dp, lay.ep)
        m.consumers["actor params"] = actor.params
        m.consumers[ACTOR_GRADS] = actor.grads
        m.consumers[ACTOR_OPTIMIZER] = actor.optimizer
        if "actor" in pool.roles and self.spec.is_moe:
            experts = expert_numel(self.params_of("actor")[local])
            m.parts["of which routed experts' params"] = experts * DTYPE_BYTES[dtype]
            m.parts["of which routed experts' grads"] = 0 if self.adapters is not None else experts * GRAD_BYTES
        if needs_critic(cfg):
            critic = ModelBytes(0)
            if "critic" in pool.roles:
                critic_params = self.params_of(layout_of, value_head=True)[local]
                critic = trained_model_bytes(critic_params, dtype, cfg.critic.optim, c.dp, lay.dp, lay.ep)
            m.consumers[CRITIC] = critic.total
        if needs_reference(cfg) and self.adapters is None:  # with LoRA the reference is the base: no second copy
            held = sum(p.numel for p in self.params_of(layout_of)[local]) if "reference" in pool.roles else 0
            m.consumers[REFERENCE] = held * DTYPE_BYTES[dtype]
        if self.rm_spec is not None:  # frozen, at its pool's layout, with its score head
            held = sum(p.numel for p in model_params(self.rm_spec, lay)[local]) if "reward_model" in pool.roles else 0
            m.consumers[REWARD_MODEL] = held * DTYPE_BYTES[dtype]

    def _engine(self, m: RankMemory, pool, rank: int) -> None:
        """The rollout engine's weights and KV cache on this rank, and the weight sync's buffers."""
        cfg, engine_key = self.cfg, self.engine_key
        generates = "rollout" in pool.roles
        e = rank - self.engines.ranks.start
        engine_numel = sum(math.prod(s.shape) for s in self.engine.ranks[e]) if generates else 0
        m.consumers[engine_key] = engine_numel * DTYPE_BYTES[self.dtype]
        kv = kv_cache_bytes(cfg.rollout, cuda=True) if cfg.rollout.backend == "vllm" and generates else 0
        if kv is None:  # 'auto': what vLLM leaves of its share of the GPU once its weights are in
            kv = int(cfg.rollout.gpu_memory_utilization * self.gpu_bytes) - m.consumers[engine_key]
        m.consumers["KV cache (configured)"] = kv
        staged = _largest_layer_bytes(self.engine, e, self.dtype) if generates else 0  # the engine stages one layer
        sends = "actor" in pool.roles or generates  # a critic pool takes no part in the weight sync's transfers
        m.consumers["reshard buffers"] = (2 * cfg.rollout.bucket_mb * MiB if sends else 0) + staged

    def _phases(self, m: RankMemory) -> None:
        """Which consumers each phase holds on this rank (and what offload moves to the host)."""
        training_state = [k for k in m.consumers if k.startswith(("actor", "critic", "reference", "reward model"))]
        m.offloaded = {k: m.consumers[k] for k in self.offloaded if k in m.consumers}
        resident = [k for k in training_state if k not in m.offloaded]
        engine_state = [self.engine_key, "KV cache (configured)"]
        if not self.shared:  # dedicated pools: every phase holds all of its own state
            held = training_state + engine_state + ["reserve (estimate)"]
            m.phases[STARTUP] = held + ["reshard buffers"]  # the engine starts, then the first sync
            m.phases[GENERATION] = held
            m.phases[SYNC] = held + ["reshard buffers"]
            m.phases[TRAINING] = held + [ACTIVATIONS, LOGITS]
        else:  # start-up: the engine is built (weights and KV cache) and first synced with the offloaded
            # state already on the host (megarl.run.job.build_job)
            m.phases[STARTUP] = resident + engine_state + ["reshard buffers", "reserve (estimate)"]
            m.phases[GENERATION] = resident + engine_state + ["reserve (estimate)"]
            m.phases[SYNC] = resident + [self.engine_key, "reshard buffers", "reserve (estimate)"]
            m.phases[TRAINING] = training_state + [ACTIVATIONS, LOGITS, "reserve (estimate)"]


def _largest_layer_bytes(engine, rank: int, dtype: str) -> int:
    """The sync stages one layer's destination tensors at a time (megarl.reshard.sync)."""
    per_layer: dict[str, int] = {}
    for s in engine.ranks[rank]:
        m = _ENGINE_LAYER.match(s.name)
        key = m.group(1) if m else s.name
        per_layer[key] = per_layer.get(key, 0) + math.prod(s.shape)
    return max(per_layer.values(), default=0) * DTYPE_BYTES[dtype]
