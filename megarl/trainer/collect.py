"""Generation and rewards for one RL step, with DAPO's dynamic sampling (drop prompt groups whose rewards are all
equal; generate more until the batch is full or ``max_gen_batches`` rounds ran)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config.schema import MegarlConfig
from megarl.data import Prompt
from megarl.rewards.parallel import score_on_ranks
from megarl.rewards.shaping import overlong_penalty
from megarl.rollout.protocol import Sample, rollout


@dataclass
class Collected:
    """A step's samples (ordered by prompt, then sample) with their rewards, identical on every rank."""

    samples: list[Sample] = field(default_factory=list)
    prompts: dict[int, Prompt] = field(default_factory=dict)
    """Global prompt index -> its prompt."""
    scores: list[float] = field(default_factory=list)
    """The reward function's score per sample."""
    rewards: list[float] = field(default_factory=list)
    """The sequence reward trained on: score plus shaping (overlong penalty)."""
    extra: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    first_error: str | None = None
    rounds: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    dropped_groups: int = 0


def _score(cfg: MegarlConfig, reward_fn, tokenizer, prompts: dict[int, Prompt], samples: list[Sample]):
    responses = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    result = score_on_ranks(
        reward_fn,
        [prompts[s.prompt_index].prompt_text for s in samples],
        responses,
        [prompts[s.prompt_index].ground_truth for s in samples],
        [prompts[s.prompt_index].extras for s in samples],
    )
    over = cfg.algorithm.overlong
    max_new = cfg.rollout.sampling.max_new_tokens
    rewards = [
        score
        + (overlong_penalty(len(s.token_ids), max_new, over.buffer_len, over.penalty_factor) if over.enable else 0)
        for score, s in zip(result.scores, samples)
    ]
    return result, rewards


def collect(cfg: MegarlConfig, engine, sampler, reward_fn, tokenizer, *, step: int, timer) -> Collected:
    """Collective: the step's batch of ``data.train_batch_size`` prompt groups (fewer only when dynamic sampling ran
    out of rounds; the caller trims to whole mini-batches)."""
    want, n = cfg.data.train_batch_size, cfg.rollout.sampling.n
    dynamic = cfg.algorithm.dynamic_sampling
    out = Collected()
    next_index = 0
    rounds = dynamic.max_gen_batches if dynamic.enable else 1
    for _ in range(rounds):
        prompts = sampler.take(want)
        by_index = {next_index + i: p for i, p in enumerate(prompts)}
        with timer("generate"):
            samples, stats = rollout(
                engine,
                [p.prompt_ids for p in prompts],
                step=step,
                sampling=cfg.rollout.sampling,
                first_index=next_index,
            )
        next_index += len(prompts)
        out.rounds += 1
        out.generated_tokens += stats.new_tokens
        out.generate_seconds += stats.seconds
        with timer("reward"):
            result, rewards = _score(cfg, reward_fn, tokenizer, by_index, samples)
        out.errors += result.errors
        out.first_error = out.first_error or result.first_error
        keep = set(by_index)
        if dynamic.enable:
            for idx in by_index:
                group = {r for s, r in zip(samples, rewards) if s.prompt_index == idx}
                if len(group) == 1:
                    keep.discard(idx)
            out.dropped_groups += len(by_index) - len(keep)
            keep = set(sorted(keep)[: want - len(out.prompts)])
        for i, s in enumerate(samples):
            if s.prompt_index in keep:
                out.samples.append(s)
                out.scores.append(result.scores[i])
                out.rewards.append(rewards[i])
                for k, values in result.extra.items():
                    out.extra.setdefault(k, []).append(values[i])
        out.prompts.update({i: by_index[i] for i in keep})
        if len(out.prompts) >= want:
            break
    assert all(len(v) == len(out.samples) for v in out.extra.values()) and len(out.samples) == n * len(out.prompts)
    return out
