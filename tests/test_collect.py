"""Dynamic sampling in ``megarl.rl.collect`` with a fake engine and reward (the rollout and the scoring
collectives replaced by plain functions): what is filtered, on which metric, the order of the kept groups, the
metrics, and the stop when ``max_gen_batches`` rounds do not fill the batch."""

import pytest

from megarl.config import load_config
from megarl.data import Prompt
from megarl.rewards.results import ScoreResult
from megarl.rewards.scorer import NoFunction
from megarl.rl import collect as collect_module
from megarl.rl.collect import DynamicSamplingExhausted, collect
from megarl.rl.timer import PhaseTimer
from megarl.rollout.protocol import RolloutStats, Sample

N = 4  # samples per prompt


class Sampler:
    def __init__(self, texts):
        self.texts, self.at = texts, 0

    def take(self, k):
        out = [
            Prompt(index=self.at + i, prompt_ids=[1], prompt_text=t)
            for i, t in enumerate(self.texts[self.at : self.at + k])
        ]
        self.at += k
        return out


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class FakeScores:
    """``GroupScores`` without collectives: each group's prompt text -> its samples' scores (``table``)."""

    table: dict = {}
    acc: dict | None = None

    def __init__(self, rewards, prompts, tokenizer, engine_tp):
        self.prompts, self.texts = prompts, []

    def add(self, group):
        self.texts += [self.prompts[s.prompt_index].prompt_text for s in group]

    def result(self):
        scores = [self.table[p][i % N] for i, p in enumerate(self.texts)]
        extra = {"acc": [self.acc[p][i % N] for i, p in enumerate(self.texts)]} if self.acc else {}
        return ScoreResult(scores=scores, failed=[""] * len(scores), extra=extra)


def _fake(monkeypatch, scores_by_prompt, acc_by_prompt=None):
    """Prompt text -> the n scores its samples get (and optional 'acc' fields)."""

    def rollout(engine, prompt_ids, *, step, sampling, seed, first_index=0, on_group=None):
        samples = [Sample(first_index + p, j, [1], [7, 7], [-0.5, -0.5], "stop", [0, 0])
                   for p in range(len(prompt_ids)) for j in range(N)]  # fmt: skip
        for p in range(len(prompt_ids)):
            on_group(samples[p * N : (p + 1) * N])
        return samples, RolloutStats(1.0, len(samples))

    monkeypatch.setattr(FakeScores, "table", scores_by_prompt)
    monkeypatch.setattr(FakeScores, "acc", acc_by_prompt)
    monkeypatch.setattr(collect_module, "rollout", rollout)
    monkeypatch.setattr(collect_module, "GroupScores", FakeScores)


def _cfg(*overrides):
    return load_config(None, ["model.path=x", "data.train_batch_size=2", f"rollout.sampling.n={N}",
                              "algorithm.dynamic_sampling.enable=true", *overrides])  # fmt: skip


class NoEngine:
    tp = 1


def _collect(cfg, texts):
    return collect(cfg, NoEngine(), Sampler(texts), None, Tokenizer(), step=1, timer=PhaseTimer())


VARIED, SAME = [0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]


def test_uniform_groups_are_set_aside_and_more_prompts_generated(monkeypatch):
    _fake(monkeypatch, {"a": SAME, "b": VARIED, "c": SAME, "d": VARIED, "e": VARIED})
    out = _collect(_cfg(), ["a", "b", "c", "d", "e"])
    assert [out.prompts[s.prompt_index].prompt_text for s in out.samples[::N]] == ["b", "d"]  # in generation order
    assert out.rounds == 2 and out.dropped_groups == 2  # a and c (round 1 and 2 took 2 prompts each)
    assert out.scores == VARIED + VARIED and out.rewards == out.scores


def test_the_filter_reads_the_acc_field_not_the_shaped_reward(monkeypatch):
    """Scores differ (partial credit) but accuracy is all 1: the group carries no accuracy signal (DAPO)."""
    partial = [0.9, 1.0, 0.8, 1.0]
    _fake(monkeypatch, {"a": partial, "b": VARIED, "c": VARIED}, acc_by_prompt={"a": SAME, "b": VARIED, "c": VARIED})
    out = _collect(_cfg(), ["a", "b", "c"])
    assert [out.prompts[s.prompt_index].prompt_text for s in out.samples[::N]] == ["b", "c"]
    out = _collect(_cfg("algorithm.dynamic_sampling.metric=score"), ["a", "b", "c"])  # the shaped reward varies
    assert [out.prompts[s.prompt_index].prompt_text for s in out.samples[::N]] == ["a", "b"]


def test_too_few_varied_groups_stop_the_run_instead_of_topping_up(monkeypatch):
    _fake(monkeypatch, {"a": SAME, "b": VARIED, "c": SAME, "d": SAME})
    with pytest.raises(DynamicSamplingExhausted, match=r"1 of data.train_batch_size=2 prompt groups had a varied acc "
                                                       r"after 2 generation rounds .*max_gen_batches=2"):  # fmt: skip
        _collect(_cfg("algorithm.dynamic_sampling.max_gen_batches=2"), ["a", "b", "c", "d"])


class RecordingEngine:
    """One engine on one rank that answers every request and records the request seeds it was given."""

    tp = 1

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, prompt_indices, seeds, sampling, on_group=None):
        self.seeds += seeds
        samples = [Sample(i, j, p, [7, 7], [-0.5, -0.5], "stop", [0, 0])
                   for p, i in zip(prompts, prompt_indices) for j in range(sampling.n)]  # fmt: skip
        for k in range(len(prompts)):
            on_group(samples[k * sampling.n : (k + 1) * sampling.n])
        return samples, RolloutStats(1.0, len(samples))


def _request_seeds(monkeypatch, *overrides):
    """The request seeds of one real ``rollout`` of a one-rank world (the collectives made local)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, **kw: out.__setitem__(0, obj))
    engine = RecordingEngine()
    cfg = load_config(None, ["model.path=x", "data.train_batch_size=2", f"rollout.sampling.n={N}", *overrides])
    collect(cfg, engine, Sampler(["a", "b"]), NoFunction(), Tokenizer(), step=1, timer=PhaseTimer())
    return engine.seeds


def test_trainer_seed_reaches_the_request_seeds_and_sampling_seed_is_an_offset(monkeypatch):
    base = _request_seeds(monkeypatch, "trainer.seed=5")
    assert len(set(base)) == 2  # one request per prompt (vLLM gives its n samples seed, seed + 1, ...)
    assert _request_seeds(monkeypatch, "trainer.seed=6") != base  # another run seed samples differently
    assert _request_seeds(monkeypatch, "trainer.seed=3", "rollout.sampling.seed=2") == base  # 3 + offset 2
