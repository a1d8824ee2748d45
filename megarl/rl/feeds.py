"""Where the step's batch comes from and how the new weights go back: one feed per ``async_training.mode``.

    Synchronous  every step: generate and score with the weights of the last update, learn, push (colocated, every
                 rank does every phase; with pools the rollout pool generates while the others wait)
    OneStepOff   the rollout pool generates step t+1's batch while the learners learn from step t's (one update old)
    Bounded      the rollout pool streams prompt groups without waiting (``megarl.rl.bounded``); the learners ask
                 it for a batch, a push, a validation, a save or the end, by ``Op``

The step (``megarl.rl.step.rl_step``) is the same for all three: ``batch``, ``overlap``, learn, ``push``. What a
feed holds in flight (one-step-off's batch ahead, the bounded stream) goes into a checkpoint through ``in_flight``
and comes back from it through the feed's constructor."""

from __future__ import annotations

import time

import torch.distributed as dist

from megarl import faults
from megarl.checkpoint.locate import ROLLOUT_BATCH, ROLLOUT_STREAM
from megarl.parallel.pools import launch_store
from megarl.reshard.sync import SyncReport
from megarl.rl.bounded import Op, Requests, RolloutServer
from megarl.rl.collect import Collected, collect
from megarl.rl.timer import PhaseTimer
from megarl.rollout.stream import oldest_version


class Synchronous:
    """Generate and score now, with the weights of the last update (colocated: every rank generates the batch)."""

    server = None
    """The rollout pool's own loop, where the feed has one (bounded)."""

    def __init__(self, job, ahead: Collected | None = None):
        self.job = job
        self.generated: list[Collected] = []
        """The batches the rollout pool generated during the current step (their times: the step's timings)."""
        self.ahead = ahead
        """The rollout pool's batch for the next step: one-step-off's, generated during the step before, or the one
        a one-step-off checkpoint held when this run resumed from it (trained on first in any mode)."""

    def batch(self, step: int, pool_time: PhaseTimer) -> Collected:
        """Collective: step ``step``'s batch, on every rank (the one ahead if there is one, else generated now)."""

        def handed_over():
            batch, self.ahead = self.ahead, None
            return batch if batch is not None else self.generate(step, pool_time)

        return self.job.place.compute_on("rollout", handed_over)

    def overlap(self, step: int, pool_time: PhaseTimer) -> None:
        """What the rollout pool does while the others learn from step ``step``'s batch: nothing here."""

    def push(self, step: int, timer: PhaseTimer) -> SyncReport:
        """Collective, after the update: the engine takes the new weights (it holds step - 1's: always a sync)."""
        if self.job.place.pooled:
            self.job.place.barrier()  # the pools that finished first wait here for the others
        with timer("sync"):
            return self.job.phases.rollout(step)

    def generate(self, step: int, pool_time: PhaseTimer) -> Collected:
        """On the rollout's ranks: step ``step``'s batch, generated with the weights the engine holds and scored; its
        times in ``Collected.generation``."""
        job, timer, start = self.job, PhaseTimer(), time.monotonic()
        with pool_time("busy"):
            batch = collect(job.cfg, job.engine, job.sampler, job.rewards, job.tokenizer, step=step, timer=timer,
                            stop=job.stop.agreed_here if job.stop is not None else None,
                            episodes=job.episodes)  # fmt: skip
        batch.generation = {**timer.seconds, "step": step, "start": start, "end": time.monotonic()}
        self.generated.append(batch)
        return batch

    def rollout_spans(self, batch: Collected, timer: PhaseTimer) -> list[dict]:
        """Collective, after the sync: what the rollout's pool did during the step, on every rank: the sampler's
        position (the trainer state), the ``generate``/``reward`` timings, and the generation spans (the timeline)."""
        place, sampler = self.job.place, self.job.sampler
        mine = (sampler.state_dict(), [b.generation for b in self.generated]) if place.hosts("rollout") else None
        self.generated = []
        data, generations = place.share(mine, "rollout")
        if not place.hosts("rollout"):
            sampler.load_state_dict(data)
        return generation_spans(place, generations, timer)

    def skipped(self, learned) -> list[str]:
        """The updates the step skipped, on every rank."""
        return learned.skipped

    def metrics_comm(self):
        """Where the ranks' step metrics are reduced: the launch (pools) or the default group (colocated: None)."""
        return self.job.place.comm if self.job.place.pooled else None

    def pool_metrics(self, batch: Collected, maxes: dict) -> None:
        """The rollout pool's own times, where its ranks did not take part in the step."""

    def in_flight(self, step: int) -> dict:
        """Collective, at a save of step ``step``: what the checkpoint must hold beside the models to continue."""
        return {}

    def validation(self, step: int, on_rollout_pool):
        """Collective: the validation's (samples, scores) on every rank, or None when a stop cut it."""
        return self.job.place.compute_on("rollout", on_rollout_pool)

    def end(self, step: int) -> None:
        """The learners are done (after step ``step``)."""


class OneStepOff(Synchronous):
    """The rollout pool hands over the batch it generated during the previous step and generates the next one (with
    the weights of the update before: one update old) while the other pools learn."""

    def __init__(self, job, ahead: Collected | None = None):
        super().__init__(job, ahead)
        self.ahead_failed: Exception | None = None

    def overlap(self, step: int, pool_time: PhaseTimer) -> None:
        """On the rollout pool: the next step's batch, with the weights the engine holds (one update old). A failure
        is raised on every pool in ``push``, once the others learned; a stop drops the batch (its prompts are taken
        again on resume)."""
        job = self.job
        self.ahead_failed = None
        if step >= job.cfg.trainer.total_steps or not job.place.hosts("rollout"):
            return
        position = job.sampler.state_dict()
        faults.fire("sigterm_ahead", step + 1, here=lambda: dist.get_rank() == 0)
        try:
            self.ahead = self.generate(step + 1, pool_time)
        except Exception as e:  # noqa: BLE001 -- raised on every pool in ``push``
            self.ahead_failed = e
        if self.ahead is not None and self.ahead.stopped:
            self.ahead = None
            job.sampler.load_state_dict(position)
            if dist.get_rank() == 0:
                print(f"[megarl] the rollout pool dropped step {step + 1}'s batch ahead: a stop", flush=True)

    def push(self, step: int, timer: PhaseTimer) -> SyncReport:
        self.job.place.compute_on("rollout", self._raise_ahead_failure)  # a failure generating ahead stops every pool
        return super().push(step, timer)

    def _raise_ahead_failure(self) -> None:
        if self.ahead_failed is not None:
            raise self.ahead_failed

    def skipped(self, learned) -> list[str]:
        """The rollout pool hears it from the actor's."""
        return self.job.place.share(learned.skipped if learned is not None else None, "actor")

    def in_flight(self, step: int) -> dict:
        """The batch generated for the next step (none after the last step)."""
        ahead = self.job.place.share(self.ahead.to_dict() if self.ahead is not None else None, "rollout")
        return {} if ahead is None else {ROLLOUT_BATCH: {"step": step + 1, "batch": ahead}}


class Bounded:
    """The learners' side of a bounded-staleness run, and on the rollout pool its server (``RolloutServer.serve``
    runs there instead of the steps). Batches arrive once their prompt groups are all scored; a push every
    ``async_training.sync_every`` updates."""

    def __init__(self, job, state_step: int, stream: dict | None = None):
        self.job = job
        self.requests = Requests(launch_store(), f"megarl/{job.place.comm.name}/ops")
        """The learners' announcements to the rollout pool."""
        self.server = None
        if job.place.hosts("rollout"):
            self.server = RolloutServer(job, self.requests, version=state_step, restored=stream)

    def announce(self, op: Op, step: int) -> None:
        """Tell the rollout pool which rendezvous the learners enter next."""
        if self.job.learns:
            self.requests.post(op, step, self.job.place.leader)

    def batch(self, step: int, pool_time: PhaseTimer) -> Collected:
        """Served by the rollout pool's stream once its groups are all scored; the staleness bound checked here."""
        job = self.job
        self.announce(Op.BATCH, step)
        handed = job.place.share(None, "rollout")
        if handed.get("stopped"):  # the rollout pool saw a stop request first
            return Collected(stopped=True)
        job.sampler.load_state_dict(handed["sampler"])  # where the stream is (the data/epoch metric)
        if handed["note"]:
            job.say(handed["note"])
        batch = handed["batch"]
        oldest, bound = min(s.weight_version for s in batch.samples), job.cfg.async_training.max_staleness
        if oldest < oldest_version(step, bound):
            raise RuntimeError(f"step {step}: a token of version {oldest} exceeds async_training.max_staleness={bound}")
        return batch

    def overlap(self, step: int, pool_time: PhaseTimer) -> None:
        """The rollout pool generates all along."""

    def push(self, step: int, timer: PhaseTimer) -> SyncReport:
        """Every ``sync_every`` updates, the rollout pool's one rendezvous."""
        if step % self.job.cfg.async_training.sync_every:
            return SyncReport("none")
        self.announce(Op.SYNC, step)
        with timer("sync"):
            return self.job.phases.rollout(step)

    def rollout_spans(self, batch: Collected, timer: PhaseTimer) -> list[dict]:
        """The rollout pool's ``generate``/``reward`` time since the previous batch (the step's timings) and its span
        (the timeline)."""
        return generation_spans(self.job.place, [batch.generation], timer)

    def skipped(self, learned) -> list[str]:
        return learned.skipped

    def metrics_comm(self):
        return self.job.learners.comm

    def pool_metrics(self, batch: Collected, maxes: dict) -> None:
        """The rollout pool's time, as it handed the batch over."""
        name, g = self.job.place.pool_name("rollout"), batch.generation
        maxes.update({f"pool/{name}/busy_s": g["generate"] + g["reward"], f"pool/{name}/wait_s": g["idle"]})

    def in_flight(self, step: int) -> dict:
        """The rollout pool's stream: cursor, finished groups, partial samples."""
        self.announce(Op.SAVE, step)
        stream = self.server.stream if self.server is not None else None
        return {ROLLOUT_STREAM: self.job.place.share(stream, "rollout")}

    def validation(self, step: int, on_rollout_pool):
        """Through the engines beside the training requests, with this step's weights (pushed first when
        ``sync_every`` > 1 left the engines older)."""
        if self.job.engine.weight_version != step:
            self.announce(Op.SYNC, step)
            self.job.phases.rollout(step)
        self.announce(Op.VALIDATE, step)
        return self.job.place.share(None, "rollout")

    def end(self, step: int) -> None:
        self.announce(Op.END, step)


def generation_spans(place, generations: list[dict], timer: PhaseTimer) -> list[dict]:
    """The rollout pool's generations (``Collected.generation``) into the step's ``generate``/``reward`` timings, and
    as spans of the timeline."""
    for g in generations:
        for phase in ("generate", "reward"):
            timer.seconds[phase] += g.get(phase, 0.0)
    name = place.pool_name("rollout")
    return [{"pool": name, "phase": "generate", "batch": g["step"], "start": g["start"], "end": g["end"]}
            for g in generations]  # fmt: skip


def make_feed(job, mode: str, state_step: int = 0, ahead: Collected | None = None, stream: dict | None = None):
    """The feed for ``async_training.mode``."""
    if mode == "bounded":
        return Bounded(job, state_step, stream)
    if mode == "one_step_off":
        return OneStepOff(job, ahead)
    return Synchronous(job, ahead)
