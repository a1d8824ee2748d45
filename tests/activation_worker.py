"""Runs inside every spawned rank: what a real Megatron chunk saves for backward (``tests.saved_tensors``), per case,
through the actor's or the critic's loss and Megatron's schedule (1F1B under PP), at the case's layout."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megarl.backend.moe import LoadBalancing
from megarl.backend.setup import wrap_for_training
from megarl.backend.step import run_schedule
from megarl.config.schema import OptimConfig
from megarl.models.builder import build_model_chunk
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from tests.parity_worker import tiny_spec
from tests.saved_tensors import SavedBytes


@dataclass(frozen=True)
class Case:
    """One counted micro-batch schedule."""

    layout: ParallelLayout
    sequences: int
    length: int
    attention: str = "sdpa"
    dtype: str = "float32"
    recompute: bool = False
    micro_batches: int = 1
    value_head: bool = False
    gqa: bool = True
    entropy_coeff: float = 0.0
    compile_elementwise: bool = False
    qk_norm: bool = False
    """Qwen3's per-head q/k RMSNorm."""
    moe: bool = False
    """Qwen3-MoE (both layers routed: ``tiny_spec(moe=True)``), with the actor's load balancing hooked."""
    aux: float = 0.0
    """The load-balancing coefficient (``actor.moe_aux_loss_coef``)."""

    @property
    def spec(self):
        if self.moe:
            return tiny_spec(moe=True)
        spec = tiny_spec()
        spec = replace(spec, family="qwen3", qkv_bias=False, qk_norm=True) if self.qk_norm else spec
        return spec if self.gqa else replace(spec, num_kv_heads=spec.num_heads)


def actor_loss(case: Case, vocab: int):
    """The trainer's actor loss (GRPO's clipped token-mean; an entropy bonus when the case has one)."""
    from megarl.backend.losses import GlobalNorm
    from megarl.backend.losses import actor_loss as trainer_actor_loss
    from megarl.config.schema import ActorConfig, AlgorithmConfig

    tokens = case.sequences * case.length * case.micro_batches
    norm = GlobalNorm(tokens=tokens, seqs=case.sequences * case.micro_batches, norm_len=case.length,
                      scale=case.micro_batches)  # fmt: skip
    return trainer_actor_loss(ActorConfig(entropy_coeff=case.entropy_coeff), AlgorithmConfig(adv_estimator="grpo"),
                              norm, temperature=1.0, true_vocab=vocab)  # fmt: skip


def critic_loss(mb, values_BS1):
    loss = ((values_BS1.squeeze(-1).float() - mb["returns"]) ** 2).mean()
    return loss, {"loss": loss.detach().clone()}


def count(case: Case) -> dict:
    """Peak saved bytes of this rank over one forward/backward schedule of the case; per rank, gathered."""
    init_distributed(case.layout, seed=1)
    spec = case.spec
    chunk = build_model_chunk(
        spec, case.layout, attention=case.attention, dtype=case.dtype, recompute=case.recompute,
        value_head=case.value_head, compile_elementwise=case.compile_elementwise,
    )  # fmt: skip
    balancing = LoadBalancing(chunk, case.aux) if case.moe else None  # noqa: F841 -- its hooks, as the actor's
    model, _ = wrap_for_training(chunk, OptimConfig(optimizer="sgd", lr=0.1))
    gen = torch.Generator().manual_seed(3)
    n, s = case.sequences, case.length
    mbs = [
        {
            "tokens": torch.randint(0, spec.vocab_size, (n, s), generator=gen),
            "position_ids": torch.arange(s).expand(n, s).contiguous(),
            "targets": torch.randint(0, spec.vocab_size, (n, s), generator=gen),
            "returns": torch.randn(n, s, generator=gen),
            "advantages": torch.randn(n, 1, generator=gen).expand(n, s).contiguous(),
            "rollout_logp": torch.zeros(n, s),
            "loss_mask": torch.ones(n, s),
        }
        for _ in range(case.micro_batches)
    ]
    with SavedBytes(chunk.parameters()) as saved:
        run_schedule(model, mbs, critic_loss if case.value_head else actor_loss(case, spec.vocab_size))
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (saved.peak, saved.live))
    return {"peak": [p for p, _ in peaks], "left": [left for _, left in peaks]}


def count_cases(cases: list[Case]) -> list[dict]:
    return [count(c) for c in cases]
