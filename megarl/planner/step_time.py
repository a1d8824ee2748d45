"""`megarl plan`'s step-time estimate: generation, learning and the weight sync of one RL step on the planned
hardware, and the step they make synchronously and one-step-off (``async_training``).

Rooflines with stated efficiencies (``Hardware.mfu``, ``decode_bw_efficiency``), not measurements. Learning: 2 FLOPs
per parameter and token for a forward, 6 for a forward and backward (8 with full recompute), over every prompt and
response token of the step (both at their configured maxima), each role on its own pool's GPUs, one role after the
other (as ``learn`` runs them). Generation: every engine decodes its share of the sequences together; each decode
step reads the engine's weight shard once (memory bound) or computes 2 FLOPs per parameter and sequence (compute
bound), whichever is slower, for ``max_new_tokens`` steps, after a compute-bound prefill of the prompts. The KV
cache's reads, the reward and stragglers are left out: real generation is longer, which only widens the gap
one-step-off closes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config.recipe import needs_critic, needs_reference, skips_old_logprob
from megarl.config.schema import MegarlConfig
from megarl.config.validate import critic_parallel, pools_of, rollout_tp
from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.planner.memory import DTYPE_BYTES, expert_numel, lora_params, model_params


@dataclass(frozen=True)
class StepTime:
    """Estimated seconds of one step's parts."""

    generate_s: float
    learn_s: float
    """Every role's forwards and updates (old log-probs, reference, values, critic and actor updates)."""
    sync_s: float

    @property
    def sync_step_s(self) -> float:
        """``async_training.mode=sync``: generate, then learn, then push the weights."""
        return self.generate_s + self.learn_s + self.sync_s

    @property
    def one_step_off_step_s(self) -> float:
        """``one_step_off``: the rollout pool generates the next batch while the others learn; then the push."""
        return max(self.generate_s, self.learn_s) + self.sync_s


def _params(spec: ModelSpec, *, value_head: bool = False, active: bool = False) -> int:
    """The model's parameters; ``active``: those one token computes with (of the routed experts, top-k of E)."""
    params = model_params(spec, ParallelLayout(), value_head=value_head)[0]
    total = sum(p.numel for p in params)
    if active and spec.is_moe:
        experts = expert_numel(params)
        total -= experts - experts * spec.moe_top_k // spec.num_experts
    return total


def step_time(cfg: MegarlConfig, spec: ModelSpec, hw, sync_s: float) -> StepTime:
    """The estimate for ``cfg`` on ``hw`` (``megarl.planner.job.Hardware``); ``sync_s``: the resharding plan's."""
    flops_s = hw.peak_tflops * 1e12 * hw.mfu
    seqs = cfg.data.train_batch_size * cfg.rollout.sampling.n
    prompt, new = cfg.data.max_prompt_length, cfg.rollout.sampling.max_new_tokens
    tokens = seqs * (prompt + new)
    train = 8 if cfg.model.recompute else 6  # FLOPs per parameter and token, forward and backward
    actor, critic = _params(spec, active=True), _params(spec, value_head=True, active=True)  # FLOPs per token
    pools = pools_of(cfg)
    a = cfg.actor.parallel
    actor_gpus = a.tp * a.pp * a.dp
    c = critic_parallel(cfg)
    critic_gpus = c.tp * c.pp * c.dp if pools else actor_gpus
    reference_gpus = next((critic_gpus for p in pools if "reference" in p.roles and "critic" in p.roles), actor_gpus)
    work = [(train * actor * tokens * cfg.actor.ppo_epochs, actor_gpus)]  # (FLOPs, GPUs)
    if not skips_old_logprob(cfg):
        work.append((2 * actor * tokens, actor_gpus))
    if needs_reference(cfg):
        work.append((2 * actor * tokens, reference_gpus))
    if needs_critic(cfg):
        work.append(((2 + train * cfg.critic.ppo_epochs) * critic * tokens, critic_gpus))
    learn_s = sum(flops / (gpus * flops_s) for flops, gpus in work)
    rollout_ranks = next((p.size for p in pools if "rollout" in p.roles), actor_gpus)
    tp = rollout_tp(cfg)
    per_engine = math.ceil(seqs / (rollout_ranks // tp))
    weights = _params(spec) * DTYPE_BYTES[cfg.model.dtype]  # a decode step reads every expert a batch routes to
    read_s = weights / tp / (hw.hbm_gb_s * 1e9 * hw.decode_bw_efficiency)
    decode_step_s = max(read_s, 2 * actor * per_engine / tp / flops_s)
    prefill_s = 2 * actor * per_engine * prompt / tp / flops_s
    return StepTime(prefill_s + new * decode_step_s, learn_s, sync_s)


def step_time_lines(t: StepTime, hw, *, one_step_off: bool) -> list[str]:
    """The report's section; ``one_step_off``: the recipe has a rollout pool (else it cannot overlap)."""
    ratio = t.sync_step_s / t.one_step_off_step_s
    bound = "generation" if t.generate_s > t.learn_s else "learning"
    return [
        f"generate {t.generate_s:.1f} s, learn {t.learn_s:.1f} s, weight sync {t.sync_s:.2f} s per step",
        f"sync: {t.sync_step_s:.1f} s per step; "
        + (f"one_step_off (async_training): {t.one_step_off_step_s:.1f} s ({ratio:.2f}x the throughput; bound by "
           f"{bound})" if one_step_off else "one_step_off needs a rollout pool (placement.pools)"),  # fmt: skip
        f"estimated: {hw.peak_tflops:g} TFLOP/s per GPU at {hw.mfu:.0%} (learning, prefill), HBM {hw.hbm_gb_s:g} GB/s "
        f"at {hw.decode_bw_efficiency:.0%} (decode), responses of max_new_tokens; rewards and stragglers left out",
    ]


OPTIMIZER_BYTES = {"adam": 8, "sgd": 0}
"""Optimizer state per trained parameter in a checkpoint: Adam's two fp32 moments; plain SGD none."""
MIN_SIGNAL_LEAD_S = 300
"""The SLURM signal lead never goes below this (``#SBATCH --signal=B:USR1@<lead>``)."""


SHA256_GB_S = 1.0
"""SHA-256 throughput of one rank's manifest hashing in GB/s: ``hashlib.sha256`` over 256 MiB measured 0.99-1.09 GB/s
on this project's Xeon CPU machines (SHA-NI)."""


@dataclass(frozen=True)
class SaveTime:
    """A training checkpoint: what it holds and how long writing and publishing it takes."""

    bytes: int
    """Trained weights (model dtype), their fp32 main copies below fp32, and the optimizer state, every model."""
    nodes: int
    write_seconds: float
    """``bytes`` spread over the nodes, each writing at ``Hardware.fs_gb_s``."""
    hash_seconds: float
    """The manifest's pass over the files written: each node's share read back at ``Hardware.fs_gb_s`` and hashed by
    its ranks at ``SHA256_GB_S`` each, whichever is slower. The publish's renames, fsyncs and the prune's deletions
    are metadata operations, not counted."""

    @property
    def seconds(self) -> float:
        return self.write_seconds + self.hash_seconds


def save_time(cfg: MegarlConfig, spec: ModelSpec, hw) -> SaveTime:
    """The estimate for ``cfg`` on ``hw``: the actor's trained parameters (its adapters with LoRA) and the critic's,
    each with its weights, fp32 main parameters (bf16/fp16 runs) and optimizer state; the frozen reference and reward
    model are not saved."""
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    main = 4 if dtype_bytes < 4 else 0
    lora = cfg.actor.lora
    actor = sum(p.numel for p in lora_params(spec, ParallelLayout(), lora)[0]) if lora else _params(spec)
    models = [(actor, cfg.actor.optim.optimizer)]
    if needs_critic(cfg):
        models.append((_params(spec, value_head=True), cfg.critic.optim.optimizer))
    total = sum(n * (dtype_bytes + main + OPTIMIZER_BYTES[opt]) for n, opt in models)
    per_node = total / hw.nodes
    hashing = min(hw.fs_gb_s, hw.gpus_per_node * SHA256_GB_S)
    return SaveTime(total, hw.nodes, per_node / (hw.fs_gb_s * 1e9), per_node / (hashing * 1e9))


def save_time_line(save: SaveTime, hw) -> str:
    return (f"checkpoint save: {save.bytes / 1e9:.1f} GB, {save.bytes / save.nodes / 1e9:.1f} GB per node at "
            f"{hw.fs_gb_s:g} GB/s: {save.seconds:.1f} s (estimate: write {save.write_seconds:.1f} s, manifest "
            f"hashing {save.hash_seconds:.1f} s)")  # fmt: skip


def signal_lead(cfg: MegarlConfig, step: StepTime, save: SaveTime) -> tuple[int, str]:
    """Seconds before the time limit SLURM should signal the job, and how they were derived: a stop cuts a
    generation, scoring or validation at once (``megarl.run.preemption``) but lets an update and its weight sync
    finish, then saves; ``trainer.stop_grace_s`` covers reaching the next poll and the ranks' agreement."""
    grace = cfg.trainer.stop_grace_s
    need = step.learn_s + step.sync_s + grace + save.seconds
    lead = max(MIN_SIGNAL_LEAD_S, math.ceil(need))
    how = (f"{lead} s = max({MIN_SIGNAL_LEAD_S}, an update in progress {step.learn_s:.1f} + sync {step.sync_s:.2f} + "
           f"trainer.stop_grace_s {grace:g} + save {save.write_seconds:.1f} + manifest hashing {save.hash_seconds:.1f} "
           "s; a generation or scoring in progress is cut)")
    return lead, how
