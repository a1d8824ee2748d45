"""Generation and rewards for one RL step, with DAPO's dynamic sampling (drop prompt groups whose rewards are all
equal; generate more until the batch is full or ``max_gen_batches`` rounds ran)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch.distributed as dist

from megarl import faults
from megarl.config.schema import MegarlConfig
from megarl.data import Prompt
from megarl.env.episodes import scored
from megarl.parallel.layout import prompt_slice
from megarl.rewards.parallel import GroupScores
from megarl.rewards.shaping import overlong_penalty
from megarl.rollout.protocol import Sample, engine_count, rollout


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
    failed: list[str] = field(default_factory=list)
    """Per sample: '' (scored), 'error' or 'timeout' (``ScoreResult.failed``)."""
    extra: dict[str, list[float]] = field(default_factory=dict)
    scored: int = 0
    """Samples scored in the step (every round of dynamic sampling)."""
    errors: int = 0
    """Of those, the samples whose scoring failed (they score 0)."""
    timeouts: int = 0
    """Of the failed samples, those that ran out of time."""
    first_error: str | None = None
    rounds: int = 0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    dropped_groups: int = 0
    """Dynamic sampling: generated groups not trained on (uniform in the filter's metric, or beyond the batch)."""
    fn_scores: list[float] = field(default_factory=list)
    """With a reward model: the reward function's part per sample (``scores`` is then the combined score)."""
    rm_scores: list[float] = field(default_factory=list)
    """With a reward model: its score per sample."""
    generation: dict[str, float] = field(default_factory=dict)
    """Where the rollout pool's time for this batch went: ``generate``/``reward`` seconds (the step's timings), and
    ``start``/``end`` (``time.monotonic``, the whole of it; the run's timeline)."""
    stopped: bool = False
    """The ranks agreed to stop while it was generated or scored: cut short, not to be trained on."""

    def to_dict(self) -> dict:
        """Plain lists and dicts (a checkpoint stores the batch in flight)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Collected:
        return cls(**{**d, "samples": [Sample(**s) for s in d["samples"]],
                      "prompts": {int(i): Prompt(**p) for i, p in d["prompts"].items()}})  # fmt: skip


def sequences_of(samples: list[Sample]) -> list[list[int]]:
    """Each sample's whole token ids (prompt + response): what a reward model scores."""
    return [s.prompt_ids + s.token_ids for s in samples]


def combined_scores(cfg, scores: list[float], rm_scores: list[float], samples: list[Sample]) -> list[float]:
    """w_function x the function's score + w_model x the reward model's, per sample (``reward.combine``), plus an
    episode's environment reward (weight 1; ``scores`` holds it beside the function's: ``env.episodes.scored``)."""
    wf, wm = cfg.weight("function"), cfg.weight("model")
    env = [sum(s.turn_rewards or ()) for s in samples]
    return [wf * (f - e) + wm * m + e for f, m, e in zip(scores, rm_scores, env)]


def combine_rewards(cfg, batch: Collected, rm_scores: list[float]) -> None:
    """``reward.combine``: the score trained on is w_function x the function's + w_model x the reward model's (the
    shaping, e.g. the overlong penalty, stays added on top; an environment's reward too); the two parts are kept for
    the metrics."""
    batch.fn_scores, batch.rm_scores = list(batch.scores), list(rm_scores)
    combined = combined_scores(cfg, batch.fn_scores, rm_scores, batch.samples)
    batch.rewards = [r - f + c for r, f, c in zip(batch.rewards, batch.fn_scores, combined)]
    batch.scores = combined


def generate(engine, prompts: list[Prompt], *, step: int, sampling, seed: int, first_index: int = 0, on_group=None,
             episodes=None, stop=None):
    """Collective: ``rollout``'s samples of ``prompts``, or with ``episodes`` (multi-turn) its episodes; ``on_group``
    gets each prompt's, as the engine finishes them (episodes: once all are done, on the ranks of their engine)."""
    if episodes is None:
        return rollout(engine, [p.prompt_ids for p in prompts], step=step, sampling=sampling, seed=seed,
                       first_index=first_index, on_group=on_group)  # fmt: skip
    samples, stats = episodes.rollout(engine, prompts, step=step, sampling=sampling, seed=seed,
                                      first_index=first_index, stop=stop)  # fmt: skip
    if on_group is not None:
        mine = set(prompt_slice(len(prompts), dist.get_rank() // engine.tp, engine_count(dist.get_world_size(),
                                                                                          engine.tp)))  # fmt: skip
        for i in sorted(mine):
            on_group([s for s in samples if s.prompt_index == first_index + i])
    return samples, stats


class DynamicSamplingExhausted(RuntimeError):
    """``max_gen_batches`` rounds did not give a full batch of varied groups (every rank sees the same groups)."""


def _shaped(cfg: MegarlConfig, scores: list[float], samples: list[Sample]) -> list[float]:
    """The rewards trained on: each score plus the overlong penalty when it is on."""
    over = cfg.algorithm.overlong
    max_new = cfg.rollout.sampling.max_new_tokens
    return [
        score
        + (overlong_penalty(len(s.token_ids), max_new, over.buffer_len, over.penalty_factor) if over.enable else 0)
        for score, s in zip(scores, samples)
    ]


@dataclass
class _Group:
    """The n samples of one prompt with their scores."""

    index: int
    prompt: Prompt
    samples: list[Sample]
    scores: list[float]
    rewards: list[float]
    failed: list[str]
    extra: dict[str, list[float]]
    metric: list[float]
    """What dynamic sampling requires to vary (``algorithm.dynamic_sampling.metric``)."""


def _filter_metric(dynamic, result, shaped: list[float]) -> list[float]:
    """Per sample, what must vary within a group: the reward's 'acc' field, else its score before shaping ('acc');
    or the shaped reward ('score')."""
    if dynamic.metric == "score":
        return shaped
    return result.extra.get("acc", result.scores)


def collect(cfg: MegarlConfig, engine, sampler, rewards, tokenizer, *, step: int, timer, stop=None, episodes=None
            ) -> Collected:  # fmt: skip
    """Collective: the step's batch of exactly ``data.train_batch_size`` prompt groups. ``stop()`` (collective over
    the same ranks; ``StopRequests.agreed_here``) is asked after each round: True returns at once, the batch marked
    ``stopped``. ``episodes``: an ``megarl.env.episodes.EpisodeRunner`` (multi-turn; its samples are episodes).

    With dynamic sampling (DAPO), groups whose ``dynamic_sampling.metric`` is the same for every sample carry no
    signal under group baselines: they are set aside and more prompts are generated, up to ``max_gen_batches``
    rounds; still short, the run stops (``DynamicSamplingExhausted``, naming the fix), as verl does."""
    want = cfg.data.train_batch_size
    dynamic = cfg.algorithm.dynamic_sampling
    out = Collected()
    kept: list[_Group] = []
    spare: list[_Group] = []
    next_index = 0
    for _ in range(dynamic.max_gen_batches if dynamic.enable else 1):
        prompts = sampler.take(want)
        by_index = {next_index + i: p for i, p in enumerate(prompts)}
        scoring = GroupScores(rewards, by_index, tokenizer, engine.tp)  # scored while the engine generates
        with timer("generate"):
            samples, stats = generate(engine, prompts, step=step, sampling=cfg.rollout.sampling, seed=cfg.trainer.seed,
                                      first_index=next_index, on_group=scoring.add, episodes=episodes, stop=stop)
        next_index += len(prompts)
        out.rounds += 1
        out.generated_tokens += stats.new_tokens
        out.generate_seconds += stats.seconds
        faults.fire("sigterm_reward", step, here=lambda: dist.get_rank() == 0)  # fault drill (a no-op in real runs)
        with timer("reward"):  # what was not scored while the engine generated
            result = scoring.result() if episodes is None else scored(samples, scoring.result())
        if stop is not None and stop():
            out.stopped = True
            return out
        shaped = _shaped(cfg, result.scores, samples)
        out.scored += len(samples)
        out.errors += result.errors
        out.timeouts += result.timeouts
        out.first_error = out.first_error or result.first_error
        for group in _groups(by_index, samples, result, shaped, _filter_metric(dynamic, result, shaped)):
            informative = not dynamic.enable or len(set(group.metric)) > 1
            (kept if informative else spare).append(group)
        if len(kept) >= want:
            break
    if len(kept) < want:
        raise DynamicSamplingExhausted(
            f"dynamic sampling: {len(kept)} of data.train_batch_size={want} prompt groups had a varied "
            f"{dynamic.metric} after {out.rounds} generation rounds (algorithm.dynamic_sampling.max_gen_batches="
            f"{dynamic.max_gen_batches}); the prompts are too easy or too hard for this policy: raise max_gen_batches "
            "or change the data"
        )
    out.dropped_groups = len(spare) + len(kept) - want
    for g in sorted(kept[:want], key=lambda g: g.index):
        out.prompts[g.index] = g.prompt
        out.samples += g.samples
        out.scores += g.scores
        out.rewards += g.rewards
        out.failed += g.failed
        for k, v in g.extra.items():
            out.extra.setdefault(k, []).extend(v)
    return out


def _groups(by_index: dict, samples: list, result, shaped: list[float], metric: list[float]) -> list[_Group]:
    """One round's samples and scores, by prompt group (in ``by_index``'s order)."""
    groups = []
    for idx, prompt in by_index.items():
        rows = [i for i, s in enumerate(samples) if s.prompt_index == idx]
        groups.append(_Group(
            idx,
            prompt,
            [samples[i] for i in rows],
            [result.scores[i] for i in rows],
            [shaped[i] for i in rows],
            [result.failed[i] for i in rows],
            {k: [v[i] for i in rows] for k, v in result.extra.items()},
            [metric[i] for i in rows],
        ))  # fmt: skip
    return groups
