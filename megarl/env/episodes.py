"""A step's episodes through the engines, turn by turn (``EpisodeRunner.rollout``).

Collective over the rollout's ranks, like ``megarl.rollout.protocol.rollout``: each engine runs the episodes of its
slice of the prompts (``sampling.n`` per prompt); every turn, all its episodes still running go into the engine as
one batch, each as its whole token sequence so far (token-in-token-out: prompt, sampled tokens, observation tokens,
never re-encoded). The environments' calls run on one rank of the engine each (in its worker processes) and their
answers are shared, so every rank of an engine sends the same requests. Then every rank gets every episode as a
``Sample``: ``token_ids`` the model's and the observations' tokens in order, ``mask`` 1 on the model's, ``logprobs``
0 and ``weight_versions`` the turn's on the observations'.

An episode ends when its environment says done, after ``env.max_turns`` model turns, or when its sequence reaches
``env.max_total_tokens`` (the last turn's ``max_new_tokens`` is cut to fit; an observation past it is cut and the
episode marked truncated). An environment call that fails (raises, returns a bad value, times out, kills its
worker) ends its episode, which scores 0 (``env/errors``, ``env/timeouts``); a failed reset still generates one turn
from the dataset's prompt (every sample has model tokens), scored 0."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.env.render import Renderer
from megarl.env.workers import Environments
from megarl.parallel.layout import prompt_slice
from megarl.rewards.results import TIMEOUT, Failure, ScoreResult
from megarl.rollout.protocol import RolloutStats, Sample, engine_count, gather_engines, request_seed

TURN_SEED_STRIDE = 104_729
"""Turn t of an episode samples with its request seed + t x this (a prime: the turns' seeds differ)."""


@dataclass
class Episode:
    """One sample's episode: its tokens so far and where its environment is (``EpisodeRunner``'s per-episode steps;
    the synchronous rollout and the bounded stream, ``megarl.env.stream``, both drive them)."""

    prompt_index: int
    sample_index: int
    record: dict
    seed: int
    prompt_ids: list[int]
    owner: bool
    """This rank runs its environment's calls (one rank per engine)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    state: bytes | dict | None = None
    """The environment between calls (pickled, on the owner), or a checkpoint's ``{"state_dict": ...}``."""
    saved: dict | None = None
    """The environment's ``state_dict()`` after its last call (classes that have one): what a checkpoint holds."""
    kind: str = "train"
    """The stream's sampling ('train' or 'val')."""
    segment: int = 0
    """Seed segment (a resume continues or restarts the episode as its next one)."""
    waiting: str | None = None
    """The environment call it waits for ('reset', 'step'), or None (a turn is generating, or it is done)."""
    source_ids: list[int] = field(default_factory=list)
    """The dataset's prompt ids (``prompt_ids`` until ``reset`` renders its own): an episode starting over."""
    done: bool = False
    finish_reason: str = "stop"
    failure: Failure | None = None
    stats: dict = field(default_factory=lambda: {"step_seconds": 0.0, "truncated": 0.0})

    def __post_init__(self):
        self.source_ids = self.source_ids or list(self.prompt_ids)

    @property
    def key(self) -> str:
        """Its id, the stream's request id of its turns."""
        return f"{self.prompt_index}.{self.sample_index}"

    def fail(self, failure: Failure) -> None:
        self.failure = self.failure or failure

    def sample(self) -> Sample:
        model = sum(self.mask)
        env = {**self.stats, "turns": float(len(self.turn_ends)), "model_tokens": float(model),
               "observation_tokens": float(len(self.mask) - model), "errors": float(self.failure is not None),
               "timeouts": float(self.failure is not None and self.failure.kind == TIMEOUT)}  # fmt: skip
        return Sample(self.prompt_index, self.sample_index, self.prompt_ids, self.tokens, self.logprobs,
                      self.finish_reason, self.versions, mask=self.mask, turn_ends=self.turn_ends,
                      turn_rewards=self.turn_rewards, env=env,
                      env_error=None if self.failure is None else f"{self.failure.kind}: {self.failure.message}")


def record_of(prompt) -> dict:
    """What ``reset`` gets: the dataset record's fields, the prompt as the record held it, the ground truth."""
    return {**prompt.extras, "prompt": prompt.source if prompt.source is not None else prompt.prompt_text,
            "ground_truth": prompt.ground_truth}  # fmt: skip


class EpisodeRunner:
    """A job's multi-turn rollout: the environments, the renderer and the limits (``env.*``)."""

    def __init__(self, cfg, tokenizer, *, max_model_len: int, budget_s: float | None = None):
        """``budget_s``: seconds one turn's environment calls may take on a rank (``reward.step_timeout_s``)."""
        self.cfg, self.tokenizer, self.max_model_len = cfg, tokenizer, max_model_len
        self.renderer = Renderer(tokenizer)
        self.envs = Environments(cfg, budget_s)

    def describe(self) -> str:
        return self.envs.describe()

    def close(self) -> None:
        self.envs.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    @property
    def should_stop(self):
        return self.envs.should_stop

    @should_stop.setter
    def should_stop(self, value) -> None:
        self.envs.should_stop = value

    def rollout(self, engine, prompts: list, *, step: int, sampling, seed: int, first_index: int = 0, stop=None
                ) -> tuple[list[Sample], RolloutStats]:  # fmt: skip
        """Collective over the world: every engine runs the episodes of its slice of ``prompts`` (``Prompt``s);
        every rank gets all of them, ordered by (prompt, sample). ``stop()`` (collective) is asked every turn: True
        ends every episode there (the caller drops the batch)."""
        world, rank, tp = dist.get_world_size(), dist.get_rank(), engine.tp
        mine = [first_index + i for i in prompt_slice(len(prompts), rank // tp, engine_count(world, tp))]
        episodes = []
        for i in mine:
            p = prompts[i - first_index]
            base_seed = request_seed(seed + sampling.seed, step, i, sampling.n)
            for j in range(sampling.n):
                owner = (len(episodes) % tp) == rank % tp
                episodes.append(Episode(i, j, record_of(p), base_seed + j, list(p.prompt_ids), owner))
        start, generated = time.perf_counter(), 0
        self._reset(episodes)
        turn = 0
        while _anywhere(any(not e.done for e in episodes)):
            if stop is not None and stop():
                break
            generated += self._generate(engine, [e for e in episodes if not e.done], sampling, turn)
            self._step(episodes, turn)
            turn += 1
        samples = [e.sample() for e in episodes]
        return gather_engines(samples, RolloutStats(time.perf_counter() - start, generated), tp)

    def _reset(self, episodes: list[Episode]) -> None:
        own = [e for e in episodes if e.owner]
        calls = self.envs.call([None] * len(own), [reset_action(e) for e in own])
        answers = shared({e.key: public(e, a) for e, a in zip(own, calls)})
        for e in episodes:
            self.started(e, answers[e.key])

    def started(self, e: Episode, got) -> None:
        """``reset``'s answer (or its ``Failure``): the episode's first prompt, rendered."""
        e.waiting = None
        if isinstance(got, Failure):
            e.fail(got)
            return
        e.stats["step_seconds"] += got["seconds"]
        e.saved = got["saved"]
        try:
            ids = self.renderer.prompt_ids(got["prompt"], e.prompt_ids, got["tools"])
        except Exception as err:  # noqa: BLE001 -- a message the template cannot render: this episode's
            e.fail(Failure("error", f"reset's prompt could not be rendered: {type(err).__name__}: {err}"))
            return
        if len(ids) >= min(self.cfg.max_total_tokens, self.max_model_len):
            e.fail(Failure("error", f"reset's prompt has {len(ids)} tokens, no room under "
                                    f"env.max_total_tokens={self.cfg.max_total_tokens}"))  # fmt: skip
            return
        e.prompt_ids = ids

    def _room(self, e: Episode) -> int:
        used = len(e.prompt_ids) + len(e.tokens)
        return min(self.cfg.max_total_tokens, self.max_model_len) - used

    def limit(self, e: Episode, sampling) -> int:
        """The next turn's ``max_new_tokens``: the sampling's, cut to the room left."""
        return min(sampling.max_new_tokens, self._room(e))

    def _generate(self, engine, active: list[Episode], sampling, turn: int) -> int:
        """One model turn of every running episode (batched, one call per distinct token limit)."""
        by_limit: dict[int, list[Episode]] = {}
        for e in active:
            by_limit.setdefault(self.limit(e, sampling), []).append(e)
        new = 0
        for limit, group in sorted(by_limit.items()):
            turn_sampling = dataclasses.replace(sampling, n=1, max_new_tokens=limit)
            samples, _ = engine.generate([e.prompt_ids + e.tokens for e in group], [e.prompt_index for e in group],
                                         [turn_seed(e, turn) for e in group], turn_sampling)  # fmt: skip
            got = {s.prompt_index: [] for s in samples}
            for s in samples:
                got[s.prompt_index].append(s)
            for e in group:
                s = got[e.prompt_index].pop(0) if got.get(e.prompt_index) else None
                if s is None or not s.token_ids:  # cut by a stop: the batch is dropped
                    e.done = True
                    continue
                self.turn_done(e, s.token_ids, s.logprobs, s.weight_versions, s.finish_reason)
                new += len(s.token_ids)
        return new

    @staticmethod
    def turn_done(e: Episode, tokens: list[int], logprobs: list[float], versions: list[int], finish_reason) -> None:
        """A model turn's tokens, appended."""
        e.tokens += tokens
        e.logprobs += logprobs
        e.mask += [1] * len(tokens)
        e.versions += versions
        e.turn_ends.append(len(e.tokens) - 1)
        e.finish_reason = finish_reason

    def step_action(self, e: Episode) -> tuple:
        """The ``step`` call on the turn just generated: its text and token ids (the model's tokens of the turn)."""
        ids = e.tokens[(e.turn_ends[-2] + 1 if len(e.turn_ends) > 1 else 0) :]
        ids = [t for t, m in zip(ids, e.mask[len(e.mask) - len(ids) :]) if m]
        return "step", self.tokenizer.decode(ids, skip_special_tokens=True), ids

    def _step(self, episodes: list[Episode], turn: int) -> None:
        """The environments answer the turn just generated; observations appended, ended episodes marked."""
        stepped = [e for e in episodes if not e.done and len(e.turn_ends) == turn + 1]
        calling = [e for e in stepped if e.owner and e.failure is None]
        calls = self.envs.call([e.state for e in calling], [self.step_action(e) for e in calling])
        answers = shared({e.key: public(e, a) for e, a in zip(calling, calls)})
        for e in stepped:
            self.answered(e, answers.get(e.key))

    def answered(self, e: Episode, got) -> None:
        """``step``'s answer (a ``Failure``; None: no call, the episode failed before): the turn's reward, the
        observation appended, or the episode done (the environment said so, a limit, a failure)."""
        e.done, e.waiting = True, None  # unless the environment goes on below
        if e.failure is not None or got is None:
            return
        if isinstance(got, Failure):
            e.fail(got)
            return
        e.turn_rewards.append(got["reward"])
        e.saved = got["saved"]
        for k, v in got["info"].items():
            e.stats[k] = e.stats.get(k, 0.0) + v
        e.stats["step_seconds"] += got["seconds"]
        if got["done"] or len(e.turn_ends) >= self.cfg.max_turns:
            return
        if self._room(e) <= 0:
            e.stats["truncated"] = 1.0
            return
        observation = self.renderer.observation_ids(got["observation"]) if got["observation"] else []
        room = self._room(e)
        if len(observation) >= room:  # the observation fills what is left: cut there, no turn after it
            observation = observation[:room]
            e.stats["truncated"] = 1.0
        version = max(e.versions[-1:] or [0])
        e.tokens += observation
        e.logprobs += [0.0] * len(observation)
        e.mask += [0] * len(observation)
        e.versions += [version] * len(observation)
        e.done = bool(e.stats["truncated"])
        if not e.done and self._room(e) <= 0:  # a turn that reached the limit ends the episode too
            e.done, e.stats["truncated"] = True, 1.0


def reset_action(e: Episode) -> tuple:
    return "reset", e.record


def turn_seed(e: Episode, turn: int) -> int:
    """Turn ``turn``'s sampling seed (each turn of an episode its own generator)."""
    return (e.seed + turn * TURN_SEED_STRIDE) % (2**31 - 1)


def public(e: Episode, answer):
    """An answer without the environment's state, kept on ``e`` (the rank that runs it; a checkpoint's saved copy
    is shared with the answer)."""
    if isinstance(answer, Failure):
        return answer
    e.state = answer["state"]
    return {k: v for k, v in answer.items() if k != "state"}


def shared(mine: dict) -> dict:
    """Collective: every rank's answers, merged (each episode's come from the one rank that runs it)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for part in everyone for k, v in part.items()}


def _anywhere(flag: bool) -> bool:
    """Collective: whether ``flag`` holds on any rank."""
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def scored(samples: list[Sample], result: ScoreResult) -> ScoreResult:
    """The episodes' scores: the reward function's (0 where it failed) plus the sum of the turns' rewards; 0 for an
    episode whose environment failed (its turn rewards zeroed too, for per-turn credit)."""
    scores = []
    for s, score, failed in zip(samples, result.scores, result.failed):
        if s.env_error is not None:
            s.turn_rewards = [0.0] * len(s.turn_rewards)
            scores.append(0.0)
        else:
            scores.append((0.0 if failed else score) + sum(s.turn_rewards))
    return dataclasses.replace(result, scores=scores)
