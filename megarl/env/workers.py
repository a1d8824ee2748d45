"""Where an environment's calls run: worker processes (isolated like user rewards: ``RewardPool(kind='calls')``
running ``megarl.env.calls.env_calls``) or the trainer's process (``env.num_workers=0``)."""

from __future__ import annotations

import dataclasses

from megarl.env.calls import env_calls
from megarl.rewards.registry import RewardLoadError
from megarl.rewards.results import Failure
from megarl.rewards.worker_pool import RewardPool, WorkerLimits, default_num_workers

CALLS = "megarl.env.preload:env_calls"
"""What the environments' worker processes run (``env_calls``, the tools' imports done as they start)."""


def environment_kwargs(cfg) -> dict:
    """The constructor's kwargs (``env.kwargs``; ``builtin:tools`` also gets ``env.tools`` and ``env.tool_parser``)."""
    if cfg.class_ == "builtin:tools":
        return {"tools": list(cfg.tools), "parser": cfg.tool_parser, **cfg.kwargs}
    return dict(cfg.kwargs)


class Environments:
    """Where environment calls run: worker processes (``env.num_workers``, isolated like user rewards) or this
    process (0). ``call`` gives one answer per call: a dict, or a ``Failure``."""

    def __init__(self, cfg, budget_s: float | None = None):
        """``budget_s``: how long one turn's calls may take on this rank (the other ranks wait in a collective);
        calls still running then fail as timeouts."""
        self.cfg, self.kwargs = cfg, environment_kwargs(cfg)
        workers = default_num_workers() if cfg.num_workers is None else cfg.num_workers
        self.pool = None
        self._answered: list[tuple] = []
        """In-process calls' answers not yet taken (``done``)."""
        if workers:
            self.pool = RewardPool(CALLS, num_workers=workers, timeout_s=cfg.timeout_s, budget_s=budget_s, kind="calls",
                                   limits=WorkerLimits.of(cfg))  # fmt: skip

    def describe(self) -> str:
        where = f"{len(self.pool.workers)} worker process(es) per rank" if self.pool else "the trainer's process"
        return f"{self.cfg.class_} in {where}, {self.cfg.timeout_s:g} s per call"

    @property
    def should_stop(self):
        return self.pool.should_stop if self.pool else None

    @should_stop.setter
    def should_stop(self, value) -> None:
        if self.pool:
            self.pool.should_stop = value

    def call(self, states: list, actions: list[tuple]) -> list:
        if not actions:
            return []
        n = len(actions)
        args = (["episode"] * n, [(self.cfg.class_, self.kwargs)] * n, states, actions)
        if self.pool is None:
            return env_calls(*args)
        self.pool.submit_calls(args, calls=n)  # one call per episode: a failure is its own
        return self.pool.finish()[0]

    def submit(self, key, state, action: tuple) -> None:
        """One call, answered later by ``done`` (a stream: the bounded rollout's episodes); in-process at once."""
        args = (["episode"], [(self.cfg.class_, self.kwargs)], [state], [action])
        if self.pool is None:
            self._answered.append((key, env_calls(*args)[0]))
        else:
            self.pool.submit_calls(args, calls=1, tag=key)

    def done(self) -> list[tuple]:
        """The calls ``submit``ted that answered since the last ``done`` (a call past ``env.timeout_s`` as its
        ``Failure``), as (key, answer); without waiting."""
        if self.pool is None:
            answered, self._answered = self._answered, []
            return answered
        return [(key, values[0]) for key, values in self.pool.take_done()]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def check_environment(cfg) -> None:
    """A dry run: the environment class (and tools) load in a worker process; RewardLoadError says why not."""
    envs = Environments(dataclasses.replace(cfg, num_workers=0 if cfg.num_workers == 0 else 1))  # one, or in-process
    try:
        (answer,) = envs.call([None], [("load",)])
    finally:
        envs.close()
    if isinstance(answer, Failure):
        last = answer.message.splitlines()[-1]  # the exception's line, without its type when it has a message
        raise RewardLoadError(f"env.class {cfg.class_!r} does not load: {last.split(': ', 1)[-1]}")
