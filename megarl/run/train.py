"""The RL loop: rollout -> rewards -> reference / old log-probs / values -> advantages -> critic and actor updates ->
weight sync -> metrics. Every rank runs the same code on the same global batch; each phase is timed.

With resource pools (``placement.pools``) each rank does the phases of the roles its pool hosts: the rollout pool
samples the prompts, generates and scores; the batch (and the sampler's position) crosses to the actor's pool, which
learns; the weights cross back through the resharding engine. Colocated, every rank does every phase and nothing
crosses (``Placement.share`` hands values through unchanged)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl import faults
from megarl.algos import rollout_is_weights
from megarl.backend.batch import Sequence
from megarl.checkpoint.format import atomic_write
from megarl.checkpoint.training import (
    ROLLOUT_BATCH,
    ROLLOUT_STREAM,
    checkpoints_root,
    complete_iterations,
    rng_states,
    save_training,
)
from megarl.config.recipe import needs_critic
from megarl.config.validate import critic_parallel
from megarl.logging.jsonl import write_rows
from megarl.parallel.layout import ParallelLayout
from megarl.reshard.sync import SyncReport
from megarl.rewards.parallel import score_on_ranks
from megarl.rewards.scorer import stop_if_broken
from megarl.rl.collect import Collected, collect, combine_rewards, combined_scores, sequences_of
from megarl.rl.estimate import advantages, pad_rows, unpad_rows
from megarl.rl.metrics import rank_values, reduce_ranks, step_metrics, summary_lines, validation_metrics
from megarl.rl.roles import Roles
from megarl.rl.state import TrainerState
from megarl.rl.timer import PhaseTimer
from megarl.rollout.protocol import rollout
from megarl.rollout.stream import oldest_version
from megarl.run.job import Job, build_job, describe_checkpoint_root, lora_identity
from megarl.run.preemption import StepAbandoned, StopRequests, launch_store
from megarl.run.resume import SAMPLES_DIR, STOPPED_FILE, TIMELINE_FILE, validation_pending


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
        with rewards, job.tracker, polled(job, stop):  # the reward's workers end with the run
            if stop.agreed(job.place):
                stopped(job, stop, state.step, "during start-up; nothing to save")
            else:
                job.phases.offload()  # the engine is awake: generation comes first
                if job.server is not None:  # bounded: the rollout pool generates until the learners post the end
                    job.server.serve(state)
                    job.server.close()
                else:
                    run_steps(job, state, stop)
    job.offloader.reload()  # the models are whole again for whoever holds the job
    return job


def run_steps(job: Job, state: TrainerState, stop: StopRequests) -> None:
    """The steps left (after a validation a stop had cut, if it was), each ended by ``end_step``; a step whose
    rollout a stop cut is dropped and the state before it saved."""
    t = job.cfg.trainer
    if state.pending_metrics is not None and end_step(job, state, state.step, state.pending_metrics, stop):
        return announce(job, "end", state.step)  # stopped again during the validation that a stop had cut
    if state.step == 0 and t.val_before_train and t.val_every and job.val_prompts and not validate_start(job, state):
        stopped(job, stop, 0, "during the validation before training; nothing to save")
        return announce(job, "end", 0)
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
    announce(job, "end", state.step)


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
    polls = [] if job.cfg.async_training.bounded else [x for x in (job.engine, job.rewards) if x is not None]
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
        trainer_state["critic_layout"] = dataclasses.asdict(ParallelLayout(tp=cp.tp, pp=cp.pp, dp=cp.dp))
    trained = job.models is not None and (job.models.actor is not None or job.models.critic is not None)
    extra = {}
    if job.cfg.async_training.one_step_off:  # the batch generated for the next step (none after the last step)
        ahead = job.place.share(job.ahead.to_dict() if job.ahead is not None else None, "rollout")
        if ahead is not None:
            extra[ROLLOUT_BATCH] = {"step": state.step + 1, "batch": ahead}
    if job.cfg.async_training.bounded:  # the rollout pool's stream: cursor, finished groups, partial samples
        announce(job, "save", state.step)
        extra[ROLLOUT_STREAM] = job.place.share(job.stream, "rollout")
    report = save_training(
        root,
        state.step,
        job.models if trained else None,  # a pool of frozen models (the reward model's) saves nothing
        trainer_state,
        keep_last=job.cfg.trainer.keep_last,
        before_manifest=lambda: faults.fire("save", state.step),
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


def rl_step(job: Job, state: TrainerState, step: int, *, poison_loss: bool = False) -> dict[str, float]:
    """One RL step; afterwards the engine holds weight version ``step``. With pools, ``pool/<name>/busy_s`` is the
    time each pool spent on its own phases and ``wait_s`` the time it waited for the others (the sync aside).
    One-step-off (``async_training``): the rollout pool hands over the batch it generated during the previous step
    and generates the next one while the other pools learn from this one; the sync then waits for both.
    ``poison_loss``: make the actor's loss NaN (fault injection)."""
    timer, pool_time, place = PhaseTimer(), PhaseTimer(), job.place
    learned, started = None, time.monotonic()
    with timer("step"):
        batch = step_batch(job, step, pool_time)
        if batch.stopped:  # on every rank alike (the batch is shared)
            raise StepAbandoned("rollout")
        if job.cfg.trainer.save_samples and place.leader:
            save_samples(job, batch, step)
        stop_if_broken(job.cfg.reward, batch.errors, batch.scored, batch.first_error, f"in step {step}")
        if batch.first_error and not job.said_reward_error:
            job.say(
                "the reward function failed on some samples; they score 0 (counted in reward/errors, timeouts also "
                f"in reward/timeouts). The first failure: {batch.first_error}"
            )
            job.said_reward_error = True
        ahead_failed = None
        if job.cfg.async_training.one_step_off and step < job.cfg.trainer.total_steps and place.hosts("rollout"):
            position = job.sampler.state_dict()
            faults.fire("sigterm_ahead", step + 1, here=lambda: dist.get_rank() == 0)
            try:  # the next step's batch, with the weights the engine holds (one update old)
                job.ahead = generate(job, step + 1, pool_time)
            except Exception as e:  # noqa: BLE001 -- raised on every pool below, once the others learned
                ahead_failed = e
            if job.ahead is not None and job.ahead.stopped:  # a stop: its prompts are taken again on resume
                job.ahead = None
                job.sampler.load_state_dict(position)
                if dist.get_rank() == 0:
                    print(f"[megarl] the rollout pool dropped step {step + 1}'s batch ahead: a stop", flush=True)
        if job.learns:
            faults.fire("sigterm_update", step)
            learn_start = time.monotonic()
            job.phases.train()
            if job.roles.reward_model is not None:
                with timer("reward_model"):
                    combine_rewards(job.cfg.reward, batch, job.roles.reward_model.scores(sequences_of(batch.samples)))
            learned = learn(
                job.cfg,
                job.roles,
                batch,
                kl_ctrl=job.kl_ctrl,
                skip_old_logprob=job.skip_old_logprob,
                timer=timer,
                poison_loss=poison_loss,
            )
            pool_time.seconds["busy"] += job.roles.busy_s()
            learn_span = {"phase": "learn", "batch": step, "start": learn_start, "end": time.monotonic()}
        if job.cfg.async_training.one_step_off:  # a failure generating ahead stops every pool
            place.compute_on("rollout", lambda: _raise(ahead_failed))
        if job.cfg.async_training.bounded:  # the push every sync_every updates, the rollout pool's one rendezvous
            report = SyncReport("none")
            if step % job.cfg.async_training.sync_every == 0:
                announce(job, "sync", step)
                with timer("sync"):
                    report = job.phases.rollout(step)
        else:
            if place.pooled:
                place.barrier()  # the pools that finished first wait here for the others
            with timer("sync"):
                report = job.phases.rollout(step)  # the engine holds step - 1: always a sync
    spans = streamed(job, batch, timer) if job.cfg.async_training.bounded else rollout_done(job, timer)
    if job.learns and place.pooled and place.leader:
        record_timeline(job, step, started, [{"pool": place.pool.name, **learn_span}, *spans])
    if job.learners is place or job.cfg.async_training.bounded:  # every rank here learned
        skipped = learned.skipped
    else:  # one-step-off: the rollout pool hears it from the actor's
        skipped = place.share(learned.skipped if job.learns else None, "actor")
    state.step = step
    state.data = job.sampler.state_dict()
    state.kl_ctrl = job.kl_ctrl.state_dict()
    if skipped:
        state.skipped_steps += 1
        state.consecutive_skips += 1
        job.say(f"step {step}: update skipped ({'; '.join(skipped)}); weights and optimizer unchanged")
        if state.consecutive_skips >= job.cfg.trainer.max_consecutive_skips:
            raise FloatingPointError(
                f"{state.consecutive_skips} consecutive RL step(s) had a non-finite loss or gradients (last: "
                f"{'; '.join(skipped)}); stopping (trainer.max_consecutive_skips="
                f"{job.cfg.trainer.max_consecutive_skips}). Lower the learning rate or check the reward function; "
                "the last checkpoint is intact"
            )
    else:
        state.consecutive_skips = 0
    sums, maxes = rank_values(report)
    if place.pooled:
        busy = pool_time.seconds["busy"]
        wait = timer.seconds["step"] - busy - timer.seconds["sync"]
        maxes.update({f"pool/{place.pool.name}/busy_s": busy, f"pool/{place.pool.name}/wait_s": wait})
    metrics = step_metrics(job, batch, learned, timer=timer, version=step - 1) if job.learns else {}
    if job.cfg.async_training.bounded:  # the rollout pool's time, as it handed the batch over
        rollout_pool = next(p.name for p in place.pools if "rollout" in p.roles)
        maxes.update({f"pool/{rollout_pool}/busy_s": batch.generation["generate"] + batch.generation["reward"],
                      f"pool/{rollout_pool}/wait_s": batch.generation["idle"]})  # fmt: skip
    comm = job.learners.comm if job.cfg.async_training.bounded else place.comm if place.pooled else None
    metrics.update(reduce_ranks(comm, sums, maxes))
    metrics["train/skipped_steps"] = float(state.skipped_steps)
    return metrics


def _raise(error: Exception | None) -> None:
    if error is not None:
        raise error


def generate(job: Job, step: int, pool_time: PhaseTimer) -> Collected:
    """On the rollout's ranks: step ``step``'s batch, generated with the weights the engine holds and scored; its
    times in ``Collected.generation`` (the batch is also listed in ``job.generated``: the current step's work)."""
    timer, start = PhaseTimer(), time.monotonic()
    with pool_time("busy"):
        batch = collect(job.cfg, job.engine, job.sampler, job.rewards, job.tokenizer, step=step, timer=timer,
                        stop=job.stop.agreed_here if job.stop is not None else None)
    batch.generation = {**timer.seconds, "step": step, "start": start, "end": time.monotonic()}
    job.generated.append(batch)
    return batch


def step_batch(job: Job, step: int, pool_time: PhaseTimer) -> Collected:
    """The step's batch, from the rollout's pool, on every rank: the one generated ahead (one-step-off, or read
    from the checkpoint resumed), else generated and scored now (colocated: every rank generates it)."""

    def on_rollout_pool():
        batch, job.ahead = job.ahead, None
        return batch if batch is not None else generate(job, step, pool_time)

    if job.cfg.async_training.bounded:  # served by the rollout pool's stream once its groups are all scored
        announce(job, "batch", step)
        handed = job.place.share(None, "rollout")
        if handed.get("stopped"):  # the rollout pool saw a stop request first
            return Collected(stopped=True)
        job.sampler.load_state_dict(handed["sampler"])  # where the stream is (the data/epoch metric)
        if handed["note"]:
            job.say(handed["note"])
        batch = handed["batch"]
        oldest = min(s.weight_version for s in batch.samples)
        if oldest < oldest_version(step, job.cfg.async_training.max_staleness):  # the bound, checked where trained
            raise RuntimeError(f"step {step}: a token of version {oldest} exceeds async_training.max_staleness="
                               f"{job.cfg.async_training.max_staleness}")  # fmt: skip
        return batch
    return job.place.compute_on("rollout", on_rollout_pool)


def announce(job: Job, op: str, step: int) -> None:
    """Bounded: tell the rollout pool which rendezvous the learners enter next (``megarl.rl.bounded``)."""
    if job.requests is not None and job.learns:
        job.requests.post(op, step, job.place.leader)


def streamed(job: Job, batch: Collected, timer: PhaseTimer) -> list[dict]:
    """Bounded: the rollout pool's ``generate``/``reward`` time since the previous batch (the step's timings) and
    its span (the timeline)."""
    g = batch.generation
    for phase in ("generate", "reward"):
        timer.seconds[phase] += g[phase]
    name = next(p.name for p in job.place.pools if "rollout" in p.roles)
    return [{"pool": name, "phase": "generate", "batch": g["step"], "start": g["start"], "end": g["end"]}]


def rollout_done(job: Job, timer: PhaseTimer) -> list[dict]:
    """Collective, after the sync: what the rollout's pool did during the step, on every rank: the sampler's
    position (the trainer state), the ``generate``/``reward`` timings, and the generation spans (the timeline)."""
    mine = (job.sampler.state_dict(), [b.generation for b in job.generated]) if job.place.hosts("rollout") else None
    job.generated = []
    data, generations = job.place.share(mine, "rollout")
    if not job.place.hosts("rollout"):
        job.sampler.load_state_dict(data)
    for g in generations:
        for phase in ("generate", "reward"):
            timer.seconds[phase] += g.get(phase, 0.0)
    name = next((p.name for p in job.place.pools if "rollout" in p.roles), "")
    return [{"pool": name, "phase": "generate", "batch": g["step"], "start": g["start"], "end": g["end"]}
            for g in generations]  # fmt: skip


def record_timeline(job: Job, step: int, started: float, spans: list[dict]) -> None:
    """The leader: the step's spans (``time.monotonic``, one clock per machine) in output_dir/timeline.jsonl."""
    rows = [{"step": step, "step_start": started, **span} for span in spans]
    with open(os.path.join(job.cfg.trainer.output_dir, TIMELINE_FILE), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


VAL_SAMPLES_SHOWN = 3
"""Validation prompts printed with their completions before training (step 0) and after the last step."""


def keep_validation_samples(job: Job, step: int, samples, scores) -> None:
    """Step ``step``'s validation completions as output_dir/samples/val_step_<N>.jsonl (prompt, response, answer,
    score, and the token ids of prompt and response); the first ``VAL_SAMPLES_SHOWN`` printed at step 0 and at the
    last step."""
    prompts = job.val_prompts
    rows = [
        {"prompt_index": s.prompt_index, "prompt": prompts[s.prompt_index].prompt_text,
         "response": job.tokenizer.decode(s.token_ids, skip_special_tokens=True),
         "answer": prompts[s.prompt_index].ground_truth, "score": score,
         "prompt_ids": list(prompts[s.prompt_index].prompt_ids), "response_ids": list(s.token_ids)}
        for s, score in zip(samples, scores)
    ]  # fmt: skip
    write_rows(os.path.join(job.cfg.trainer.output_dir, SAMPLES_DIR, f"val_step_{step:07d}.jsonl"), rows)
    if step in (0, job.cfg.trainer.total_steps):
        shown = sorted(rows, key=lambda r: r["prompt_index"])[:VAL_SAMPLES_SHOWN]
        for r in shown:
            prompt = " ".join(r["prompt"].split())[-90:]
            job.say(f"step {step} validation: ...{prompt!r} -> {r['response']!r} (answer {r['answer']}, score "
                    f"{r['score']:g})")  # fmt: skip


def save_samples(job: Job, batch, step: int) -> None:
    """``trainer.save_samples``: the step's samples as output_dir/samples/step_<N>.jsonl."""
    rows = [
        {
            "prompt_index": s.prompt_index,
            "prompt": batch.prompts[s.prompt_index].prompt_text,
            "response": job.tokenizer.decode(s.token_ids, skip_special_tokens=True),
            "score": score,
            "reward": reward,
            "failed": failed,
        }
        for s, score, reward, failed in zip(batch.samples, batch.scores, batch.rewards, batch.failed)
    ]
    write_rows(os.path.join(job.cfg.trainer.output_dir, SAMPLES_DIR, f"step_{step:07d}.jsonl"), rows)


@dataclass
class Learned:
    """What one update computed on the step's batch (global, identical on every rank)."""

    seqs: list[Sequence]
    rollout_logp: list[torch.Tensor]
    old_logp: list[torch.Tensor] | None
    ref_logp: list[torch.Tensor] | None
    values: list[torch.Tensor] | None
    returns: list[torch.Tensor] | None
    advantages: list[torch.Tensor]
    actor: dict[str, float]
    critic: dict[str, float]
    kl: dict[str, float]
    skipped: list[str]
    """Updates not applied because their loss or gradients were not finite ("actor: non-finite pg_loss")."""


def learn(
    cfg, roles: Roles, batch, *, kl_ctrl, skip_old_logprob: bool, timer: PhaseTimer, poison_loss=False
) -> Learned:
    """Collective: old / reference log-probs and values, advantages, then the critic's and the actor's updates on the
    step's samples (the exact token ids the engine generated). A model's update whose loss or gradients are not
    finite is not applied (see ``ppo_updates``) and is named in ``Learned.skipped``. ``poison_loss``: make the
    actor's loss NaN (fault injection)."""
    seqs = [Sequence(s.prompt_ids + s.token_ids, len(s.prompt_ids)) for s in batch.samples]
    lengths = [s.response_len for s in seqs]
    rollout_logp = [torch.tensor(s.logprobs, dtype=torch.float32) for s in batch.samples]
    actor, reference, critic = roles.actor, roles.reference, roles.critic

    with timer("old_logprob"):
        old_logp = None if skip_old_logprob else actor.logprobs(seqs)
    with timer("ref"):
        ref_logp = reference.logprobs(seqs) if reference is not None else None
    with timer("values"):
        values = critic.values(seqs) if critic is not None else None
    with timer("advantages"):
        adv_NR, returns_NR, kl_metrics = advantages(
            cfg.algorithm,
            torch.tensor(batch.rewards, dtype=torch.float32),
            torch.tensor([s.prompt_index for s in batch.samples]),
            pad_rows([torch.ones(n) for n in lengths]),
            behaviour_logp_NR=pad_rows(old_logp or rollout_logp),
            ref_logp_NR=pad_rows(ref_logp) if ref_logp is not None else None,
            values_NR=pad_rows(values) if values is not None else None,
            kl_ctrl=kl_ctrl,
            kl_metric_type=cfg.actor.kl_loss_type,
        )
    adv = unpad_rows(adv_NR, lengths)
    if poison_loss:
        adv = [a * float("nan") for a in adv]
    returns = unpad_rows(returns_NR, lengths) if returns_NR is not None else None
    updates = {}
    with timer("update_critic"):
        if critic is not None:
            updates["critic"] = critic.update(seqs, {"old_values": values, "returns": returns})
    with timer("update_actor"):
        trained, rejected = None, {}
        if cfg.algorithm.rollout_is == "seq_mask":  # decided on pi_old for whole sequences, before the update
            trained, rejected = seq_mask_accepted(old_logp, rollout_logp, cfg.algorithm)
        fields = {"advantages": adv, "rollout_logp": rollout_logp}
        if old_logp is not None:
            fields["old_logp"] = old_logp
        if cfg.actor.kl_loss_coef > 0:
            fields["ref_logp"] = ref_logp
        updates["actor"] = actor.update(seqs, fields, trained=trained)
        if updates["actor"].skipped is None:
            updates["actor"].metrics.update(rejected)
    skipped = [f"{name}: {u.skipped}" for name, u in updates.items() if u.skipped is not None]
    critic_metrics = updates["critic"].metrics if "critic" in updates else {}
    return Learned(
        seqs, rollout_logp, old_logp, ref_logp, values, returns, adv, updates["actor"].metrics, critic_metrics,
        kl_metrics, skipped,
    )  # fmt: skip


def seq_mask_accepted(old_logp: list[torch.Tensor], rollout_logp: list[torch.Tensor], algo):
    """``rollout_is=seq_mask``: which sequences stay in the actor's loss (their pi_old / pi_rollout statistic at
    ``algo.rollout_is_level`` within [1/cap, cap]; the loss weighs each by it) and the rejection metrics."""
    mask_NR = pad_rows([torch.ones(len(x)) for x in old_logp])
    weights = rollout_is_weights(pad_rows(old_logp), pad_rows(rollout_logp), mask_NR, "seq_mask",
                                 algo.rollout_is_cap, algo.rollout_is_level)  # fmt: skip
    accepted = (weights["weights"][:, 0] > 0).tolist()
    metrics = {
        "rollout/is_masked_frac": float(weights["masked"].sum() / mask_NR.sum().clamp(min=1)),
        "rollout/is_rejected_seqs": 1.0 - sum(accepted) / max(len(accepted), 1),
    }
    return accepted, metrics


def validate(job: Job, step: int) -> dict[str, float] | None:
    """Collective: one sample per validation prompt with ``rollout.val_sampling``, scored (on the rollout's pool, and
    by the reward model, combined as in training); ``val/*`` metrics on every rank. None when a stop request cut it
    (agreed on the rollout's pool, then shared)."""
    prompts = job.val_prompts
    cut = job.stop.agreed_here if job.stop is not None else lambda: False

    def on_rollout_pool():
        samples, _ = rollout(
            job.engine,
            [p.prompt_ids for p in prompts],
            step=step,
            sampling=job.cfg.rollout.val_sampling,
            seed=job.cfg.trainer.seed,
        )
        if cut():
            return None
        result = score_on_ranks(
            job.rewards,
            [p.prompt_text for p in prompts],
            [job.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples],
            [p.ground_truth for p in prompts],
            [p.extras for p in prompts],
        )
        return None if cut() else (samples, result)

    if job.cfg.async_training.bounded:  # through the engines beside the training requests, with this step's weights
        if job.engine.weight_version != step:  # sync_every > 1: pushed first
            announce(job, "sync", step)
            job.phases.rollout(step)
        announce(job, "validate", step)
        samples, result = job.place.share(None, "rollout")
    else:
        done = job.place.compute_on("rollout", on_rollout_pool)
        if done is None:
            return None
        samples, result = done
    stop_if_broken(job.cfg.reward, result.errors, len(samples), result.first_error, f"in step {step}'s validation")
    if job.roles.reward_model is not None and job.learns:  # one-step-off: the rollout pool needs no val/ metric
        job.phases.train()  # the reward model's weights back on the device
        rm = job.roles.reward_model.scores(sequences_of(samples))
        if not job.place.pooled:  # resyncs only if the engine freed its weights while asleep (GPU, colocated)
            job.phases.rollout(step)
        result.scores = combined_scores(job.cfg.reward, result.scores, rm)
    if job.place.leader:
        keep_validation_samples(job, step, samples, result.scores)  # the scores val/reward/mean averages
    return validation_metrics(result, samples)
