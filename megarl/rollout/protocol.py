"""The rollout protocol: what every generation engine (vLLM, HF generate) offers the trainer, and the data contract.

Data contract (the same for every backend):
- The rollout TP size is configurable (default: the actor's TP). Engines are blocks of ``rollout_tp`` consecutive
  ranks, so there are ``world / rollout_tp`` engines; engine ``e`` is made of ranks ``e*tp .. e*tp + tp - 1``.
- Each engine generates a distinct, contiguous slice of the step's prompts (``prompt_slice``).
- All ranks of one engine submit identical requests in the same order, each with an explicit seed that is identical
  across the engine's ranks and distinct across prompts and engines (``request_seed``).
- Results are gathered on every rank and redistributed to the actor's data-parallel ranks for training.
- Every generated token carries the weight version that produced it. An engine whose last weight sync failed or was
  partial is unhealthy and refuses to generate until a full sync succeeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from megarl.parallel.layout import prompt_slice

if TYPE_CHECKING:
    from megarl.config.schema import SamplingConfig
    from megarl.reshard.sync import SyncReport


class EngineUnhealthyError(RuntimeError):
    """The engine does not hold a complete, verified weight version."""


@dataclass
class Sample:
    """One generated continuation."""

    prompt_index: int
    """Global index of the prompt in the step's batch."""
    sample_index: int
    """Which of the prompt's n samples this is."""
    prompt_ids: list[int]
    token_ids: list[int]
    """Generated tokens (the prompt excluded)."""
    logprobs: list[float]
    """Per generated token: log-probability under the processed (temperature-scaled) distribution."""
    finish_reason: str
    """'stop' (EOS or a stop token) or 'length' (max_new_tokens reached)."""
    weight_versions: list[int]
    """Per generated token: the weight version that generated it (an observation's token: its turn's)."""
    mask: list[int] | None = None
    """An episode (``megarl.env``): per token of ``token_ids``, 1 for the model's, 0 for an observation's (which
    has no behaviour log-prob: 0.0 in ``logprobs``, and stays out of the loss). None: every token is the model's."""
    turn_ends: list[int] | None = None
    """An episode: the index in ``token_ids`` of each model turn's last token."""
    turn_rewards: list[float] | None = None
    """An episode: each turn's reward from the environment."""
    env: dict[str, float] | None = None
    """An episode's counts (turns, tool calls, tokens, ...; the ``env/`` metrics)."""
    env_error: str | None = None
    """Why the episode's environment failed ('error: ...', 'timeout: ...'); it then scores 0."""
    routed_experts: torch.Tensor | None = None
    """A MoE sample recorded by its engine (``megarl.rollout.routes``): ``[P + G - 1, MoE layers, k]`` experts, row
    ``i`` for input position ``i`` of ``prompt_ids + token_ids``. None: not recorded."""

    @property
    def weight_version(self) -> int:
        """The oldest weight version among the sample's tokens."""
        return min(self.weight_versions)

    @property
    def model_mask(self) -> list[int]:
        """1 per token the model generated, 0 per observation token."""
        return self.mask if self.mask is not None else [1] * len(self.token_ids)

    @property
    def response_ids(self) -> list[int]:
        """What a reward function reads: the response, or an episode's last model turn."""
        if self.turn_ends is None or len(self.turn_ends) < 2:
            return [t for t, m in zip(self.token_ids, self.model_mask) if m]
        last = self.token_ids[self.turn_ends[-2] + 1 : self.turn_ends[-1] + 1]
        return [t for t, m in zip(last, self.mask[self.turn_ends[-2] + 1 : self.turn_ends[-1] + 1]) if m]


@dataclass
class RolloutStats:
    seconds: float
    new_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class RolloutEngine(Protocol):
    """The interface the trainer uses; ``vllm`` and ``hf`` implement it."""

    weight_version: int | None
    """The verified weight version held, or None (unhealthy: generation refused)."""
    tp: int
    """Ranks per engine (consecutive); HF engines are single-rank."""
    adapter_slots: bool
    """Whether the engine serves the actor's LoRA adapters itself (the base once, then adapters); else they arrive
    merged into the weights."""

    def update_weights(
        self, src_tensors: dict[str, torch.Tensor], version: int, *, resend_base: bool = False
    ) -> SyncReport: ...

    def generate(
        self, prompts: list[list[int]], prompt_indices: list[int], seeds: list[int], sampling: SamplingConfig,
        on_group=None,
    ) -> tuple[list[Sample], RolloutStats]:  # fmt: skip
        """``sampling.n`` samples per prompt; ``on_group(samples)`` with each prompt's as soon as they are done."""

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    @property
    def healthy(self) -> bool: ...


def check_requests(prompts: list[list[int]], max_new_tokens: int, max_model_len: int) -> None:
    """Refuse, before the engine sees them, prompts that cannot fit their response within ``max_model_len``."""
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > max_model_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with rollout.sampling.max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} > rollout.max_model_len={max_model_len}; shorten the prompts or raise "
                "max_model_len"
            )


def engine_count(world_size: int, rollout_tp: int) -> int:
    if world_size % rollout_tp:
        raise ValueError(f"rollout TP={rollout_tp} does not divide the world size {world_size}")
    return world_size // rollout_tp


def request_seed(base_seed: int, step: int, prompt_index: int, n: int) -> int:
    """Seed of one prompt's request. vLLM gives sample i the seed + i, so prompts are spaced n apart; steps are
    spaced by a large odd stride. Identical on every rank of an engine (it does not depend on the rank)."""
    return (base_seed + step * 1_000_003 * max(n, 1) + prompt_index * n) % (2**31 - 1)


def rollout(
    engine, prompts: list[list[int]], *, step: int, sampling, seed: int, first_index: int = 0, on_group=None
) -> tuple[list, RolloutStats]:
    """Collective over the world: every engine generates its slice of ``prompts``; every rank gets all samples,
    ordered by (prompt, sample). Raises if the ranks of one engine disagree (they must sample identically).
    Request seeds derive from ``seed`` (the run's ``trainer.seed``) + ``sampling.seed`` (an offset), the step and
    the prompt. ``on_group(samples)``: on the ranks of the engine that generated them, each prompt's samples as soon
    as they are done (``megarl.rewards.parallel.GroupScores`` scores them while the engine goes on).

    Prompt ``i`` gets the global index ``first_index + i`` (its samples' ``prompt_index`` and its seed), so several
    rounds of one step (dynamic sampling) never share seeds."""
    import torch.distributed as dist

    world, rank, rollout_tp = dist.get_world_size(), dist.get_rank(), engine.tp
    engines = engine_count(world, rollout_tp)
    mine = [first_index + i for i in prompt_slice(len(prompts), rank // rollout_tp, engines)]
    seeds = [request_seed(seed + sampling.seed, step, i, sampling.n) for i in mine]
    samples, stats = engine.generate([prompts[i - first_index] for i in mine], mine, seeds, sampling, on_group)
    return gather_engines(samples, stats, rollout_tp)


def gather_engines(samples: list[Sample], stats: RolloutStats, rollout_tp: int) -> tuple[list[Sample], RolloutStats]:
    """Collective over the world: every engine's samples (from its first rank; its other ranks must agree) on every
    rank, ordered by (prompt, sample), and the rollout's stats."""
    import torch.distributed as dist

    world = dist.get_world_size()
    engines = engine_count(world, rollout_tp)
    everyone = [None] * world
    dist.all_gather_object(everyone, (samples, stats))
    out = []
    for e in range(engines):
        lead = everyone[e * rollout_tp][0]
        for r in range(e * rollout_tp + 1, (e + 1) * rollout_tp):
            if [(s.token_ids, s.logprobs) for s in everyone[r][0]] != [(s.token_ids, s.logprobs) for s in lead]:
                raise RuntimeError(f"ranks {e * rollout_tp} and {r} of rollout engine {e} generated different samples")
        out.extend(lead)
    total = RolloutStats(
        max(s.seconds for _, s in everyone), sum(everyone[e * rollout_tp][1].new_tokens for e in range(engines))
    )
    return sorted(out, key=lambda s: (s.prompt_index, s.sample_index)), total


def samples_for_dp_rank(samples: list[Sample], dp_rank: int, dp: int) -> list[Sample]:
    """The actor data-parallel rank's share: a contiguous block of whole prompt groups (GRPO needs every sample of a
    prompt on one rank)."""
    prompts = sorted({s.prompt_index for s in samples})
    mine = set(prompts[i] for i in prompt_slice(len(prompts), dp_rank, dp))
    return [s for s in samples if s.prompt_index in mine]
