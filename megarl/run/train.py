"""A run's life (``megarl train``): the job built, the steps (``megarl.rl.step.rl_step``) each ended by its
validation, metrics and periodic save, and the stop: a SIGTERM/SIGUSR1 ends the run within ``trainer.stop_grace_s``
plus a save (``megarl.run.preemption``). With ``async_training.mode=bounded`` the rollout pool runs its own loop
(``megarl.rl.bounded.RolloutServer.serve``) instead of the steps and joins the learners' validations and saves."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from megarl import faults
from megarl.checkpoint.format import atomic_write
from megarl.checkpoint.locate import checkpoints_root, complete_iterations
from megarl.checkpoint.training import rng_states, save_training
from megarl.config.recipe import needs_critic
from megarl.config.validate import critic_parallel
from megarl.parallel.layout import ParallelLayout
from megarl.rl.metrics import summary_lines
from megarl.rl.state import TrainerState
from megarl.rl.step import StepAbandoned, rl_step, validate
from megarl.run.job import Job, build_job, describe_checkpoint_root, lora_identity
from megarl.run.preemption import StopRequests, launch_store
from megarl.run.resume import STOPPED_FILE, validation_pending


def train(cfg, spec, source, engine=None, stop: StopRequests | None = None) -> Job:
    """Run RL steps up to ``trainer.total_steps`` (collective over the world), continuing a checkpoint when
    ``trainer.resume`` finds one; returns the job (its engine can serve another job of the same model and layout).

    A SIGTERM/SIGUSR1 (``megarl.run.preemption``; ``stop``: handlers installed earlier, else here, before
    anything is built) ends the run within ``trainer.stop_grace_s`` plus a save: a generation, scoring or validation
    in progress is cut, its rollout dropped and the state from before it saved (with the RNG states of then, so the
    resumed run repeats it bitwise); an update or weight sync in progress finishes and the step is saved. During
    start-up nothing is saved. ``job.stopped_by`` then names the signal."""
    with stop or StopRequests() as stop:
        job, state = build_job(cfg, spec, source, engine=engine)
        stop.connect(launch_store)
        rewards = job.rewards if job.rewards is not None else contextlib.nullcontext()
        episodes = job.episodes if job.episodes is not None else contextlib.nullcontext()
        with rewards, episodes, job.tracker, polled(job, stop):  # the reward's and environments' workers end with it
            if stop.agreed(job.place):
                stopped(job, stop, state.step, "during start-up; nothing to save")
            else:
                job.phases.offload()  # the engine is awake: generation comes first
                server = job.feed.server  # bounded: the rollout pool generates until the learners post the end
                if server is not None:
                    server.serve(state, save=lambda state: save(job, state))
                    server.close()
                else:
                    run_steps(job, state, stop)
    job.offloader.reload()  # the models are whole again for whoever holds the job
    return job


def run_steps(job: Job, state: TrainerState, stop: StopRequests) -> None:
    """The steps left (after a validation a stop had cut, if it was), each ended by ``end_step``; a step whose
    rollout a stop cut is dropped and the state before it saved."""
    t = job.cfg.trainer
    if state.pending_metrics is not None and end_step(job, state, state.step, state.pending_metrics, stop):
        return job.feed.end(state.step)  # stopped again during the validation that a stop had cut
    if state.step == 0 and t.val_before_train and t.val_every and job.val_prompts and not validate_start(job, state):
        stopped(job, stop, 0, "during the validation before training; nothing to save")
        return job.feed.end(0)
    for step in range(state.step + 1, t.total_steps + 1):
        faults.fire("sigterm", step)  # fault injection (tests, drills): a no-op in normal runs
        faults.fire("generate", step, after_s=0.05)
        rng = rng_states()  # what the step starts from: saved if its rollout is dropped
        try:
            metrics = rl_step(job, state, step, poison_loss=faults.at("nan_loss", step))
        except StepAbandoned as e:
            if state.step == 0:  # nothing to continue: the same command starts over (resume=auto)
                stopped(job, stop, 0, f"during step 1's {e.where}: no step completed, nothing to save")
            else:
                how = "saved" if save_dropped(job, state, rng) else "its checkpoint holds"
                what = f"during step {step}'s {e.where}: it is dropped; {how} step {state.step}"
                stopped(job, stop, state.step, what)
            break
        if end_step(job, state, step, metrics, stop):
            break
    else:
        job.tracker.finish(summary_lines(state.history) if job.place.leader else None)  # one-step-off: the rollout
        # pool holds no metrics of its own
    job.feed.end(state.step)


def validate_start(job: Job, state: TrainerState) -> bool:
    """Collective: the starting weights' validation, logged as step 0 (``trainer.val_before_train``); False when a
    stop request cut it."""
    val = validate(job, 0)
    if val is None:
        return False
    job.tracker.log(0, val)
    state.history.append({"step": 0, **val})
    return True


@contextlib.contextmanager
def polled(job: Job, stop: StopRequests):
    """While the run lasts, the engine's generation and the reward's waits look at ``stop`` (bounded async keeps
    its own schedule: its stream is saved whole)."""
    job.stop = stop
    polls = [] if job.cfg.async_training.bounded else [x for x in (job.engine, job.rewards, job.episodes)
                                                          if x is not None]  # fmt: skip
    for x in polls:
        x.should_stop = stop.requested
    try:
        yield
    finally:
        job.stop = None
        for x in polls:
            x.should_stop = None


def end_step(job: Job, state: TrainerState, step: int, metrics: dict, stop: StopRequests) -> bool:
    """After step ``step``'s update: its validation, its metrics logged, a periodic save, and the stop agreed at the
    step boundary (collective over the launch). Whether the run stops here."""
    t = job.cfg.trainer
    resumed_pending = state.pending_metrics is not None  # its checkpoint still waits for this validation
    if t.val_every and job.val_prompts and (step % t.val_every == 0 or step == t.total_steps):
        rng = rng_states()
        faults.fire("sigterm_validate", step, here=lambda: job.place.rank == job.place.ranks("rollout").start)
        val = validate(job, step)
        if val is None:  # cut: the step is saved without it, validated again on resume
            state.pending_metrics = metrics
            save(job, state, rng=rng)
            stopped(job, stop, step, f"during step {step}'s validation; saved step {step}, to validate again on resume")
            return True
        metrics.update(val)
    state.pending_metrics = None
    job.tracker.log(step, metrics)
    state.history.append({"step": step, **metrics})
    stopping = stop.agreed(job.learners if job.cfg.async_training.bounded else job.place)
    last = step == t.total_steps
    if stopping or resumed_pending or (t.save_every and (step % t.save_every == 0 or last)):
        save(job, state)
    if stopping and last:  # nothing left to resume: a complete run
        job.say(f"{stop.by} during the last step: saved; the run is complete")
    elif stopping:
        stopped(job, stop, step, f"after step {step}; saved")
        return True
    return False


def save_dropped(job: Job, state: TrainerState, rng: dict) -> bool:
    """Collective, after a dropped step: save ``state`` (the previous step's) with the RNG states ``rng`` unless its
    checkpoint is already complete (the periodic save at the end of that step, or the checkpoint this run resumed
    from, unless that one still waited for its validation: the same state). Bounded async always saves: its rollout
    stream moved on since. Whether it saved."""
    if job.cfg.async_training.bounded:  # the rollout pool serves the save (its own loop, not in ``place.any``)
        save(job, state, rng=rng)
        return True
    root = checkpoints_root(job.cfg.trainer.output_dir)
    same = [p for s, p in complete_iterations(root)[0] if s == state.step] if job.place.leader else []
    if job.place.any(bool(same) and not validation_pending(same[0])):
        return False
    save(job, state, rng=rng)
    return True


def stopped(job: Job, stop: StopRequests, saved: int, what: str) -> None:
    """The run ends after a stop request: ``output_dir/STOPPED`` ('step <the step a resume continues from>: ...';
    the launcher then exits ``EXIT_PREEMPTED``) and one line saying what happened and how long it took."""
    job.stopped_by = stop.by
    if job.place.leader:
        atomic_write(os.path.join(job.cfg.trainer.output_dir, STOPPED_FILE),
                     f"step {saved}: stopped by {stop.by} {what}\n")  # fmt: skip
    grace = job.cfg.trainer.stop_grace_s
    late = stop.since is not None and time.monotonic() - stop.since > grace
    job.say(f"stopped by {stop.by} {what}; resume with the same command (the stop took {stop.took()}"
            + (f", more than trainer.stop_grace_s={grace:g}: an update or save in progress finished first)" if late
               else ")"))  # fmt: skip


def save(job: Job, state: TrainerState, rng: dict | None = None) -> dict:
    """Collective over the launch: a training checkpoint of this step under ``output_dir/checkpoints``. With pools,
    the actor's pool writes it and a critic pool adds its models; the rollout pool's sampler position is in the
    trainer state, and one-step-off's batch already generated for the next step (prompts, tokens, log-probs,
    versions, rewards) beside it, so a resume continues with that batch. ``rng``: this rank's RNG states when
    ``state`` held (default: now)."""
    faults.fire("sigterm_save", state.step)
    root = checkpoints_root(job.cfg.trainer.output_dir)
    if job.place.leader:
        describe_checkpoint_root(job, root)
    if job.offloader.enabled:  # the optimizer state is on the host: bring it back, with the engine asleep
        job.phases.train()
    trainer_state = {"state": state.to_dict(), "layout": dataclasses.asdict(job.layout),
                     "world_size": job.layout.world_size, "lora_base": job.lora_base,
                     "lora": lora_identity(job.cfg.actor.lora)}  # fmt: skip
    if needs_critic(job.cfg):
        cp = critic_parallel(job.cfg)
        trainer_state["critic_layout"] = dataclasses.asdict(ParallelLayout.of(cp))
    trained = job.models is not None and (job.models.actor is not None or job.models.critic is not None)
    extra = job.feed.in_flight(state.step)  # one-step-off's batch ahead, bounded's stream
    report = save_training(
        root,
        state.step,
        job.models if trained else None,  # a pool of frozen models (the reward model's) saves nothing
        trainer_state,
        keep_last=job.cfg.trainer.keep_last,
        before_manifest=lambda: faults.fire("save", state.step),
        fault=lambda point: faults.fire(point, state.step),
        finishes=job.place.hosts("actor"),
        barrier=job.place.barrier,
        extra=extra,
        rng=rng,
    )
    if job.offloader.enabled:
        job.phases.rollout(state.step)  # re-syncs only if the engine freed its weights to make room
    if report:
        job.say(
            f"saved step {state.step}: {report['path']} ({report['bytes'] / 1e6:.1f} MB, {report['seconds']:.2f}s, "
            f"hashing {report['hash_seconds']:.2f}s)"
        )
    return report
