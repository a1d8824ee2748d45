"""Streaming generation for bounded-staleness asynchronous RL (``../shared/facts/pools-and-async.md`` sections 2,
4.4, 4.5): prompt groups go into a vLLM engine one at a time, the caller steps the engine, and whole groups come back
as they finish, every token tagged with the weight version that produced it.

Why not ``LLM.generate``: it forces final-only outputs and steps until every request is done, so nothing can be
admitted mid-batch and a weight push could not land between two decode steps. Here each sample is its own request
(``n=1``, seed ``seed + i`` as vLLM's own fan-out of ``n`` gives sample ``i``) with delta outputs, accumulated by
the session.

Partial rollout (``recompute``): a weight push between two ``step`` calls pre-empts the requests in flight
(``VLLMEngine.update_weights`` resets the prefix cache with its running requests); they re-prefill their prompt and
the tokens generated so far under the new weights and continue with their own seeded generators, so a sample's
tokens before the push carry the old version and its log-probs, those after the new ones.

The staleness bound (AReaL's admission rule): with ``B`` prompts per batch, prompt serial ``i`` (0-based, in data
order) may be admitted while the engine holds version ``v`` only if ``i < (max_staleness + v + 1) * B``. Batch ``t``
(1-based) is made of serials ``(t-1)*B .. t*B-1`` and trained at version ``t-1``, so each of its tokens comes from a
version ``>= t - 1 - max_staleness``.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from megarl.rollout.protocol import Sample, check_requests


def admission_limit(max_staleness: int, version: int, batch_prompts: int) -> int:
    """How many prompts (serials ``0 ..``) may have been admitted while the engine holds ``version``."""
    return (max_staleness + version + 1) * batch_prompts


def batch_of(serial: int, batch_prompts: int) -> int:
    """The step (1-based) that trains prompt ``serial``."""
    return serial // batch_prompts + 1


def oldest_version(step: int, max_staleness: int) -> int:
    """The oldest weight version a token trained at ``step`` may come from (trained at version ``step - 1``)."""
    return step - 1 - max_staleness


def stream_seed(base_seed: int, serial: int, n: int, segment: int = 0) -> int:
    """Seed of prompt ``serial``'s first sample (sample ``i`` gets ``+ i``), the same on every rank of an engine.
    ``segment`` counts resubmissions of the prompt's unfinished samples (after a resume): a resubmitted request
    starts a new generator, which must not replay the first segment's draws."""
    return (base_seed + serial * max(n, 1) + segment * 1_000_003 * max(n, 1)) % (2**31 - 1)


@dataclass
class Request:
    """One sample of a prompt group, in flight or finished."""

    serial: int
    sample_index: int
    prompt_ids: list[int]
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    """None while in flight."""
    segment: int = 0
    """How often the request was resubmitted (a resume continues it as prompt + tokens so far)."""
    kind: str = "train"
    """Which of the session's samplings it uses ('train', or 'val': a validation prompt)."""
    routes: torch.Tensor | None = None
    """A recording engine's routed experts (``Sample.routed_experts``): once finished, every computed position's;
    in a snapshot of a request in flight, those recorded so far (a resume keeps them)."""

    @property
    def request_id(self) -> str:
        return f"{self.serial}.{self.sample_index}"

    def sample(self) -> Sample:
        return Sample(self.serial, self.sample_index, list(self.prompt_ids), list(self.token_ids),
                      list(self.logprobs), self.finish_reason or "length", list(self.weight_versions),
                      routed_experts=self.routes)  # fmt: skip


class StreamSession:
    """Prompt groups streamed through one vLLM engine (on each of its ranks, with identical calls: the engine's
    TP ranks must schedule identically). The caller submits groups, calls ``step`` and syncs weights between steps.
    """

    def __init__(self, engine, sampling, val_sampling=None):
        """``engine``: a ``VLLMEngine``; ``sampling``: the ``SamplingConfig`` of the training prompts, ``val_sampling``
        the validation prompts' (``submit(..., kind="val")``)."""
        self.engine = engine
        self.samplings = {"train": sampling, "val": val_sampling or sampling}
        self.requests: dict[str, Request] = {}
        """Every request submitted and not yet handed back, by id."""
        self.steps = 0
        """Engine steps taken."""

    @property
    def in_flight(self) -> int:
        """Requests not finished."""
        return sum(r.finish_reason is None for r in self.requests.values())

    def submit(self, serial: int, prompt_ids: list[int], seed: int, kind: str = "train", segment: int = 0) -> None:
        """Queue prompt ``serial``'s ``n`` samples (sample ``i`` with seed ``seed + i``) with the ``kind`` sampling;
        ``segment``: the seed segment ``seed`` belongs to (a prompt generated again after a resume). Serials identify
        groups: a validation prompt's must differ from every training prompt's."""
        sampling = self.samplings[kind]
        check_requests([prompt_ids], sampling.max_new_tokens, self.engine.max_model_len)
        for i in range(sampling.n):
            request = Request(serial, i, list(prompt_ids), seed + i, segment=segment, kind=kind)
            self.add(request, sampling.max_new_tokens)

    def add(self, request: Request, max_tokens: int) -> None:
        sampling = dataclasses.replace(self.samplings[request.kind], n=1, max_new_tokens=max_tokens)
        self.engine.add_request(request.request_id, request.prompt_ids + request.token_ids, sampling, request.seed)
        self.requests[request.request_id] = request

    def step(self) -> list[list[Sample]]:
        """One engine step (nothing if no request is in flight); the prompt groups it finished, each whole (every
        sample finished), in the order they finished."""
        done = []
        for request in self.step_requests():
            if request.request_id not in self.requests:  # its group ended with another sample of this step
                continue
            n = self.samplings[request.kind].n
            group = [self.requests[f"{request.serial}.{i}"] for i in range(n)]
            if all(r.finish_reason is not None for r in group):
                done.append([r.sample() for r in group])
                for r in group:
                    del self.requests[r.request_id]
        return done

    def step_requests(self) -> list[Request]:
        """One engine step (nothing if no request is in flight); the requests it finished (kept in ``requests``)."""
        if not self.engine.busy:
            return []
        version, done = self.engine.weight_version, []
        self.steps += 1
        for request_id, tokens, logprobs, finish_reason in self.engine.step():
            request = self.requests[request_id]
            request.token_ids += tokens
            request.logprobs += logprobs
            request.weight_versions += [version] * len(tokens)
            if finish_reason is not None:
                request.finish_reason = finish_reason
                if self.engine.routes is not None:
                    positions = len(request.prompt_ids) + len(request.token_ids) - 1
                    request.routes = self.engine.routes.take(request_id, positions)
                done.append(request)
        return done

    def exchange(self, hold: bool = False) -> list[list[Sample]]:
        """Collective over the rollout pool in an ``EpisodeStream``; single-turn samples have nothing to exchange."""
        return []

    def drop(self, kind: str) -> None:
        """Abort and forget the requests of one sampling (``'val'``: a validation cut by a stop)."""
        ids = [rid for rid, r in self.requests.items() if r.kind == kind]
        self.engine.abort(ids)
        for rid in ids:
            del self.requests[rid]

    def abort(self) -> None:
        """Abort every request in flight (the engine can serve another job)."""
        self.engine.abort(list(self.requests))
        self.requests = {}

    def snapshot(self) -> list[dict]:
        """Every request submitted and not handed back (a group's finished samples too), as plain data (a checkpoint
        holds it)."""
        saved = []
        for r in self.requests.values():
            fields = dataclasses.asdict(r)
            if self.engine.routes is not None and r.finish_reason is None:  # in flight: the rows recorded so far
                fields["routes"] = self.engine.routes.so_far(r.request_id)
            saved.append(fields)
        return saved

    def restore(self, requests: list[dict], seed_of) -> None:
        """Continue a ``snapshot``'s requests: a finished one waits for its group; an unfinished one is resubmitted as
        its prompt plus its tokens with the budget left, as its next segment with seed ``seed_of(serial, segment) +
        sample_index`` (a new generator: it must not replay the previous segment's draws)."""
        for fields in requests:
            r = Request(**copy.deepcopy(fields))  # the snapshot stays as it was
            if r.finish_reason is not None:
                self.requests[r.request_id] = r
                continue
            r.segment += 1
            r.seed = seed_of(r.serial, r.segment) + r.sample_index
            self.add(r, self.samplings[r.kind].max_new_tokens - len(r.token_ids))
            if r.routes is not None and self.engine.routes is not None:
                self.engine.routes.resume(r.request_id, r.routes)

    def drain(self) -> list[list[Sample]]:
        """Step until no request is in flight (``partial_rollout: none`` before a weight push); the groups finished."""
        done = []
        while self.engine.busy:
            done += self.step()
        return done

