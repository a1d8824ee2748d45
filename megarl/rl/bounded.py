"""``async_training.mode=bounded``: the rollout pool streams prompt groups through its engines without waiting for
the trainer (``../shared/facts/pools-and-async.md`` sections 4.4-4.7).

The two sides never run the same loop. The learners run the RL steps; each time they need the rollout pool (a batch,
a weight push, a validation, a save, the end) they announce it on the launch's store (``Requests.post``: numbered
operations) and enter the matching collective. The rollout pool generates: every ``poll_every`` engine steps its
ranks take one collective decision (``RolloutServer.decide``: the pool's first rank reads the next operation and
broadcasts it over the pool, so every engine's ranks act at the same engine step) and serve the operation when they
can: a batch once its prompt groups are all finished and scored, a push at once (``partial_rollout=recompute``: the
requests in flight are pre-empted and recompute under the new weights) or once the engines are empty (``none``:
admission stops meanwhile).

Batches are made in data order: batch t is prompt serials (t-1)B .. tB-1 (B = data.train_batch_size), so with the
admission rule (``megarl.rollout.stream``) every token trained at step t comes from a version >= t-1-max_staleness,
every prompt is trained once, and a long answer holds back its own batch, not the engines (they keep generating the
next ones, up to the bound).
"""

from __future__ import annotations

import time
from enum import StrEnum

import torch.distributed as dist

from megarl.data import Prompt
from megarl.env.episodes import record_of, scored
from megarl.env.stream import EpisodeStream
from megarl.rewards.parallel import GroupScores, score_on_ranks
from megarl.rewards.results import CANCELLED, ScoreResult, merge
from megarl.rl.collect import Collected, _shaped
from megarl.rollout.protocol import Sample
from megarl.rollout.stream import StreamSession, admission_limit, batch_of, oldest_version, stream_seed

POLL_IDLE_S = 0.002
"""How long an idle rollout pool sleeps between decisions (nothing to generate: it waits for the trainer)."""


class Op(StrEnum):
    """What the learners ask of the rollout pool, in the order they enter the matching collective."""

    BATCH = "batch"
    """Hand over the next step's batch once its prompt groups are all scored."""
    SYNC = "sync"
    """Take the new weights."""
    VALIDATE = "validate"
    """Generate and score the validation prompts beside the training requests."""
    SAVE = "save"
    """Write the stream into the checkpoint the learners save."""
    END = "end"
    """The learners are done: the server returns."""


class Requests:
    """The learners' announcements to the rollout pool, numbered, on the launch's store (``post`` on the actor's
    first rank; ``next`` on the rollout pool's first rank, without waiting)."""

    def __init__(self, store, prefix: str):
        self.store, self.prefix, self.count = store, prefix, 0

    def post(self, op: Op, step: int, leader: bool) -> None:
        if leader:
            self.store.set(f"{self.prefix}/{self.count}", f"{op.value} {step}")
        self.count += 1

    def next(self) -> tuple[Op, int] | None:
        """The next operation if it was posted (then it counts as read)."""
        key = f"{self.prefix}/{self.count}"
        if not self.store.check([key]):
            return None
        op, step = self.store.get(key).decode().split()
        self.count += 1
        return Op(op), int(step)


class RolloutServer:
    """The rollout pool's side of a bounded run: admission, engine steps, rewards as groups finish, and the
    learners' operations. Every rank of the pool runs it; the default process group is the pool's."""

    def __init__(self, job, requests: Requests, version: int, restored: dict | None = None):
        cfg = job.cfg
        self.job, self.requests, self.version = job, requests, version
        self.a = cfg.async_training
        self.batch = cfg.data.train_batch_size
        self.total = cfg.trainer.total_steps * self.batch
        """Serials to generate in the whole run (nothing is admitted beyond them)."""
        self.seed = cfg.trainer.seed + cfg.rollout.sampling.seed
        self.n = cfg.rollout.sampling.n
        tp = job.engine.tp
        self.engines, self.engine = dist.get_world_size() // tp, dist.get_rank() // tp
        self.lead = dist.get_rank() % tp == 0
        """This engine's first rank: it speaks for the engine (its requests in a checkpoint, its validation samples;
        the engine's other ranks hold the same)."""
        self.session = StreamSession(job.engine, cfg.rollout.sampling, cfg.rollout.val_sampling)
        if job.episodes is not None:  # multi-turn: the stream's samples are episodes, its requests their turns
            self.session = EpisodeStream(self.session, job.episodes, tp)
        self.cursor = 0
        """Serials admitted so far (pool-wide, in data order)."""
        self.prompts: dict = {}
        """Serial -> its ``Prompt``, admitted and not yet handed over."""
        self.scoring = GroupScores(job.rewards, self.prompts, job.tokenizer, tp)
        """Each finished group goes to one rank of its engine's reward workers (``GroupScores.owns``)."""
        self.unscored: dict[int, list[Sample]] = {}
        """This rank's finished groups submitted to the reward workers and not collected yet."""
        self.scored: dict[int, tuple[list[Sample], ScoreResult]] = {}
        """This rank's finished, scored groups not yet handed over."""
        self.next_step = 1
        """The step whose batch is handed over next."""
        self.pending: tuple[Op, int] | None = None
        self.busy_s = self.reward_s = 0.0
        self.since = time.monotonic()
        self.val_done: list = []
        """Validation groups finished (during a ``validate``)."""
        self.dropped: list[int] = []
        """Serials a resume generated again (their samples were older than their batch may hold)."""
        self.readmit: dict[int, int] = {}
        """A resume's prompts to generate again (serial -> its next seed segment), admitted under the bound."""
        self.note: str | None = None
        """What a resume kept and dropped, said by the learners with the first batch."""
        self.stream = restored
        """The stream as the last save wrote it (first: the resumed checkpoint's), for the checkpoint."""
        if restored is not None:
            self._restore(restored)

    # --- the loop ------------------------------------------------------------------------------------------------
    def serve(self, state, save) -> None:
        """Generate and serve the learners' operations until they post ``Op.END``; ``save(state)``: the run's
        collective save (``megarl.run.train.save``), which a ``Op.SAVE`` joins."""
        while True:
            if self.pending is None:
                self.pending = self.decide()
            hold = self.pending is not None and self.pending[0] == Op.SYNC and self.a.partial_rollout == "none"
            for group in self.session.exchange(hold):  # episodes: the environments' answers (collective)
                self._finished(group)
            if self.pending is not None and self._serve(self.pending, state, save):
                if self.pending[0] == Op.END:
                    return
                self.pending = None
                continue
            self._admit()
            start = time.monotonic()
            stepped = False
            for _ in range(self.a.poll_every):
                if not self.job.engine.busy:
                    break
                stepped = True
                for group in self.session.step():
                    self._finished(group)
            if stepped:
                self.busy_s += time.monotonic() - start
            else:
                time.sleep(POLL_IDLE_S)

    def decide(self) -> tuple[Op, int] | None:
        """Collective over the pool: the learners' next operation, if its first rank saw one posted."""
        seen = [self.requests.next() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(seen, src=0)
        if dist.get_rank() != 0 and seen[0] is not None:
            self.requests.count += 1
        return seen[0]

    def _admit(self) -> None:
        """Admit prompts in data order while the staleness bound allows (not while a push waits for the engines)."""
        if self.pending is not None and self.pending[0] == Op.SYNC and self.a.partial_rollout == "none":
            return
        limit = min(admission_limit(self.a.max_staleness, self.version, self.batch), self.total)
        for serial in [s for s in self.readmit if s < limit]:  # a resume's prompts generated again, in order
            self._submit(serial, self.prompts[serial], segment=self.readmit.pop(serial))
        while self.cursor < limit:
            prompt = self.job.sampler.take(1)[0]
            self.prompts[self.cursor] = prompt
            self._submit(self.cursor, prompt, segment=0)
            self.cursor += 1

    def _submit(self, serial: int, prompt: Prompt, segment: int, kind: str = "train", seed: int | None = None) -> None:
        """Prompt ``serial``'s group into this engine's stream if the engine is its (``serial % engines``; a
        validation prompt's serial is negative)."""
        if serial % self.engines == self.engine:
            seed = stream_seed(self.seed, serial, self.n, segment) if seed is None else seed
            episodes = {"record": record_of(prompt)} if self.job.episodes is not None else {}
            self.session.submit(serial, prompt.prompt_ids, seed, kind=kind, segment=segment, **episodes)

    def _finished(self, group: list[Sample]) -> None:
        serial = group[0].prompt_index
        if serial < 0:  # a validation prompt's
            self.val_done.append(group)
            return
        if self.scoring.owns(serial):
            self.scoring.add(group)
            self.unscored[serial] = group

    def _collect_scores(self) -> None:
        """Wait for the scores of every group submitted so far."""
        if not self.unscored:
            return
        start = time.monotonic()
        for serial, result in self.scoring.collect().items():
            self.scored[serial] = (self.unscored.pop(serial), result)
        self.reward_s += time.monotonic() - start

    def _collect_scores_within(self, seconds: float) -> None:
        """``_collect_scores``, the reward's calls cancelled after ``seconds``: the groups whose scoring was cut are
        dropped (their prompts stay admitted, without samples: a resume generates them again)."""
        deadline = time.monotonic() + seconds
        self.job.rewards.should_stop = lambda: time.monotonic() > deadline
        try:
            self._collect_scores()
        finally:
            self.job.rewards.should_stop = None
        for serial in [s for s, (_, r) in self.scored.items() if CANCELLED in r.failed]:
            del self.scored[serial]

    # --- the learners' operations ----------------------------------------------------------------------------------
    def _serve(self, op: tuple[Op, int], state, save) -> bool:
        """Serve ``op`` if it can be now (collective over the pool, then with the learners); whether it was."""
        name, step = op
        if name == Op.BATCH:
            return self._hand_over(step)
        if name == Op.SYNC:
            if self.a.partial_rollout == "none" and self._pool_sum(self.session.in_flight):
                return False  # the push waits for the requests in flight; admission has stopped
            self.job.phases.rollout(step)  # recompute: the requests in flight re-prefill under the new weights
            self.version = step
            return True
        if name == Op.VALIDATE:
            self._validate(step)
            return True
        if name == Op.SAVE:
            self._save(step, state, save)
            return True
        return name == Op.END

    def _pool_sum(self, value: int | list[int]) -> int | list[int]:
        """Collective over the pool: the sum of ``value`` (or of each of a list of values)."""
        import torch

        t = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.int64)
        dist.all_reduce(t)
        return t.tolist() if isinstance(value, list) else int(t.item())

    def _stop_requested(self, fresh: bool = False) -> int:
        """This rank's ``StopRequests.requested`` (``fresh``: read the store now; else at most every 0.5 s)."""
        return int(self.job.stop is not None and self.job.stop.requested(fresh))

    def _hand_over(self, step: int) -> bool:
        serials = range((step - 1) * self.batch, step * self.batch)
        mine = sum(s in self.scored or s in self.unscored for s in serials)  # the groups this rank scores
        have, stopping = self._pool_sum([mine, self._stop_requested()])
        if stopping:  # the learners drop the step and save: the stream goes on into the checkpoint as it is
            self.job.place.share({"stopped": True}, "rollout")
            return True
        if have < len(serials):
            return False
        self._collect_scores()
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {s: self.scored.pop(s) for s in serials if s in self.scored})
        groups = {s: g for part in parts for s, g in part.items()}
        batch = self._batch(step, [groups[s] for s in serials], {s: self.prompts.pop(s) for s in serials})
        self.next_step = step + 1
        self.job.place.share(batch, "rollout")
        return True

    def _batch(self, step: int, groups: list, prompts: dict) -> dict:
        samples = [s for g, _ in groups for s in g]
        result = merge([r for _, r in groups])
        if self.job.episodes is not None:  # the environments' rewards beside the function's
            result = scored(samples, result)
        now = time.monotonic()
        idle = max(now - self.since - self.busy_s - self.reward_s, 0.0)
        collected = Collected(
            samples=samples,
            prompts=prompts,
            scores=result.scores,
            rewards=_shaped(self.job.cfg, result.scores, samples),
            failed=result.failed,
            extra=result.extra,
            scored=len(samples),
            errors=result.errors,
            timeouts=result.timeouts,
            first_error=result.first_error,
            rounds=1,
            generated_tokens=sum(sum(s.model_mask) for s in samples),
            generate_seconds=self.busy_s,
            generation={"generate": self.busy_s, "reward": self.reward_s, "idle": idle, "step": step,
                        "start": self.since, "end": now},
        )  # fmt: skip
        self.busy_s = self.reward_s = 0.0
        self.since = now
        note, self.note = self.note, None
        return {"batch": collected, "sampler": self.job.sampler.state_dict(), "note": note}

    def _validate(self, step: int) -> None:
        """The validation prompts through the engines beside the training requests (which go on), scored; the
        samples and scores on every rank (``validate``'s ``compute_on``)."""
        prompts = self.job.val_prompts
        self.val_done = []
        val_seed = self.job.cfg.trainer.seed
        for i, p in enumerate(prompts):
            self._submit(-(i + 1), p, 0, kind="val", seed=stream_seed(val_seed, i, 1) + step)
        mine = sum(-(i + 1) % self.engines == self.engine for i in range(len(prompts)))
        while True:  # collective: episodes exchange their answers meanwhile
            left, stopping = self._pool_sum([mine - len(self.val_done), self._stop_requested()])
            if not left:
                break
            if stopping:  # an environment may be slow or hang: the validation is cut, the learners save
                self.session.drop("val")
                self.val_done = []
                self.job.place.share(None, "rollout")
                return
            for group in self.session.exchange():
                self._finished(group)
            if not self.job.engine.busy:  # episodes waiting for their environments
                time.sleep(POLL_IDLE_S)
            for group in self.session.step():
                self._finished(group)
        self._collect_scores()  # the training groups submitted so far: validation scores on the same workers
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, [s for g in self.val_done for s in g] if self.lead else [])
        samples = sorted((s for part in parts for s in part), key=lambda s: -s.prompt_index)
        for s in samples:
            s.prompt_index = -s.prompt_index - 1
        result = score_on_ranks(
            self.job.rewards,
            [p.prompt_text for p in prompts],
            [self.job.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples],
            [p.ground_truth for p in prompts],
            [p.extras for p in prompts],
        )
        if self.job.episodes is not None:
            result = scored(samples, result)
        self.job.place.share((samples, result), "rollout")

    def close(self) -> None:
        """Abort what is still in flight (nothing, after a whole run): the engine can serve another job."""
        self.session.abort()

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def _save(self, step: int, state, save) -> None:
        if self._pool_sum(self._stop_requested(fresh=True)):  # a stop: the scores wait at most stop_grace_s
            self._collect_scores_within(self.job.cfg.trainer.stop_grace_s)
        else:
            self._collect_scores()
        parts = [None] * dist.get_world_size()
        mine = (self.session.snapshot() if self.lead else [], self.scored)
        dist.all_gather_object(parts, mine)
        self.stream = {
            "step": step,
            "cursor": self.cursor,
            "version": self.version,
            "sampler": self.job.sampler.state_dict(),
            "prompts": {s: vars(p) for s, p in self.prompts.items()},
            "requests": [r for part, _ in parts for r in part if r["kind"] == "train"],
            "scored": {s: ([vars(x) for x in g], vars(r)) for _, part in parts for s, (g, r) in part.items()},
        }
        state.step = step
        save(state)

    def _oldest(self, serial: int) -> int:
        """The oldest version a token of prompt ``serial`` may come from."""
        return oldest_version(batch_of(serial, self.batch), self.a.max_staleness)

    def _restore(self, saved: dict) -> None:
        """Continue a checkpoint's stream (resumed at version ``self.version`` = its step): groups and partial samples
        with a token older than their batch may hold are dropped and their prompts generated again."""
        self.job.sampler.load_state_dict(saved["sampler"])
        self.cursor, self.next_step = saved["cursor"], saved["step"] + 1
        self.prompts.update({int(s): Prompt(**p) for s, p in saved["prompts"].items()})  # the dict scoring reads
        fresh = {}
        for s, (group, result) in saved["scored"].items():
            samples = [Sample(**x) for x in group]
            if min(x.weight_version for x in samples) >= self._oldest(int(s)):
                fresh[int(s)] = (samples, ScoreResult(**result))
        requests = {}
        for r in saved["requests"]:
            requests.setdefault(r["serial"], []).append(r)
        keep = []  # partial groups whose tokens so far are fresh enough, admissible now (a tighter bound may not be)
        limit = admission_limit(self.a.max_staleness, self.version, self.batch)
        for s, rs in requests.items():
            old = self._oldest(s)
            if s < limit and all(min(r["weight_versions"], default=self.version) >= old for r in rs):
                keep += rs
        self.scored = {s: g for s, g in fresh.items() if s % self.engines == self.engine and self.scoring.owns(s)}
        kept_serials = set(fresh) | {r["serial"] for r in keep}
        mine = [r for r in keep if r["serial"] % self.engines == self.engine]
        self.session.restore(mine, lambda serial, segment: stream_seed(self.seed, serial, self.n, segment))
        self.dropped = sorted(s for s in self.prompts if s not in kept_serials)
        partial = sum(r["finish_reason"] is None for r in keep)
        self.note = (f"resumed the rollout stream at prompt {self.cursor}: {len(fresh)} finished group(s) kept, "
                     f"{partial} partial sample(s) continued, {len(self.dropped)} prompt(s) generated again (a token "
                     f"older than max_staleness={self.a.max_staleness} allows)")  # fmt: skip
        # generated again from their first token as their next segment, once the bound admits them (``_admit``)
        self.readmit = {s: 1 + max((r["segment"] for r in requests.get(s, [])), default=0) for s in self.dropped}
