"""Everything an RL run holds, built once on every rank: data, reward, models, the rollout engine and the tracker.

The order matters: the process groups first, then the Megatron models, then the vLLM engine (it reuses the process
group), then the first weight sync (version 0: the initial actor weights; the engine starts without weights).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import pickle
import shutil
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.algos import kl_controller
from megarl.backend.models import ALL_ROLES, RLModels, build_rl_models
from megarl.backend.offload import Offloader
from megarl.checkpoint import format as ckpt
from megarl.checkpoint.format import atomic_write
from megarl.checkpoint.locate import (
    DAMAGED_DIR,
    ROLLOUT_BATCH,
    ROLLOUT_STREAM,
    abandon_later,
    checkpoints_root,
    finish_interrupted_saves,
    point_latest,
    read_trainer_state,
    set_aside,
)
from megarl.checkpoint.manifest import ManifestError, verify_file, verify_manifest
from megarl.checkpoint.training import load_training, set_rng_states
from megarl.compat import cpu as cpu_compat
from megarl.compat.host_memory import keep_freed_memory
from megarl.config.loader import to_yaml
from megarl.config.recipe import old_logprobs_needed_by, skips_old_logprob
from megarl.config.schema import MegarlConfig
from megarl.config.validate import adapter_slots, layout_config, max_model_len, pool_layout_role, pools_of
from megarl.convert.hf_io import copy_tokenizer_files
from megarl.data import Prompt, PromptDataset, PromptSampler
from megarl.env.episodes import EpisodeRunner
from megarl.logging import Tracker
from megarl.logging.jsonl import TIMELINE_FILE, read_metrics, write_rows
from megarl.lora.checkpoint import base_fingerprint, same_base
from megarl.models.source import ModelSource
from megarl.models.spec import ModelSpec
from megarl.parallel.init import default_backend, init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.pools import Placement
from megarl.reshard.sync import push_actor
from megarl.rewards.scorer import open_rewards
from megarl.rl.collect import Collected
from megarl.rl.feeds import Bounded, OneStepOff, Synchronous, make_feed
from megarl.rl.phases import Phases
from megarl.rl.roles import Roles, make_roles
from megarl.rl.state import TrainerState
from megarl.rollout import build_engine, write_engine_dir
from megarl.run.preemption import StopRequests
from megarl.run.resume import (
    METRICS_FILE,
    STOPPED_FILE,
    ResumeError,
    clear_previous_run,
    holds_previous_run,
    plan_start,
    set_aside_previous_run,
)

log = logging.getLogger("megarl.trainer")


@dataclass
class Job:
    """The resources of one run (a plain holder; the loop in ``loop.py`` does the work)."""

    cfg: MegarlConfig
    source: ModelSource
    spec: ModelSpec
    layout: ParallelLayout
    """The actor's layout (on its pool)."""
    place: Placement
    """Where each role runs (colocated: everywhere) and how values cross between pools."""
    rank: int
    tokenizer: object
    sampler: PromptSampler
    val_prompts: list[Prompt]
    rewards: object
    """The reward, ready to score (``megarl.rewards.scorer``: in this process, or a pool of worker processes); None
    outside the rollout's pool (rewards are scored where the samples are generated)."""
    models: RLModels | None
    """None outside the actor's pool."""
    engine: object
    """The rollout engine; outside the rollout's pool, a ``RemoteEngine`` (the weight syncs' sending half)."""
    tracker: Tracker
    kl_ctrl: object
    skip_old_logprob: bool
    """One mini-batch and one epoch: the policy before the update is the current one, so no separate forward."""
    offloader: Offloader
    """Moves training state to host memory while the engine generates (``offload.*``)."""
    roles: Roles
    """The step's models as roles (``actor.logprobs``, ``critic.update``, ...), wherever they live."""
    phases: Phases
    """Switches between generation and training (sleep, offload) and pushes the weights."""
    episodes: object = None
    """Multi-turn (``env.class``): the environments and the renderer (``megarl.env.episodes.EpisodeRunner``), on the
    rollout's pool; None otherwise."""
    said_reward_error: bool = False
    """The first reward failure is printed once per run."""
    said_env_error: bool = False
    """The first environment failure is printed once per run."""
    stopped_by: str | None = None
    """The signal that stopped the run early (after a save), if one did."""
    stop: StopRequests | None = None
    """The run's stop requests (``train`` sets them): the generation rounds and validation agree on them."""
    lora_base: dict | None = None
    """LoRA: the frozen base's fingerprint (``megarl.lora.checkpoint.base_fingerprint``), saved in checkpoints."""
    learners: Placement | None = None
    """The ranks that learn and how they share the learning phases (the roles'): every rank (``place``), but with
    ``async_training.mode=one_step_off`` or ``bounded`` the pools but the rollout's (None on the rollout pool)."""
    feed: Synchronous | OneStepOff | Bounded | None = None
    """Where the step's batch comes from and how the weights go back, by ``async_training.mode``
    (``megarl.rl.feeds``); it holds what is in flight between steps (one-step-off's batch ahead, bounded's stream)."""

    @property
    def learns(self) -> bool:
        return self.learners is not None

    def say(self, message: str) -> None:
        if self.place.leader:
            print(f"[megarl] {message}", flush=True)


def _datasets(cfg: MegarlConfig, tokenizer) -> tuple[PromptDataset, PromptDataset | None]:
    d = cfg.data
    kwargs = dict(
        tokenizer=tokenizer,
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        max_prompt_length=d.max_prompt_length,
        on_overlong=d.on_overlong,
    )
    train = PromptDataset.from_files(d.train_files, split="train", **kwargs)
    val = PromptDataset.from_files(d.val_files, split="val", **kwargs) if d.val_files else None
    return train, val


def describe_checkpoint_root(job: Job, root: str) -> None:
    """Rank 0, before the first save: the model description and tokenizer that make ``root`` a megarl checkpoint
    (so the export, verify and ``model.path`` read a training checkpoint's actor like a converted one)."""
    if os.path.isfile(os.path.join(root, ckpt.META_FILE)):
        return
    os.makedirs(root, exist_ok=True)
    copy_tokenizer_files(job.source.tokenizer_dir, os.path.join(root, ckpt.TOKENIZER_DIR))
    ckpt.write_meta(
        root,
        {
            "family": job.spec.family,
            "hf_config": job.source.hf_config,
            "vocab_size": job.spec.vocab_size,
            "padded_vocab_size": job.spec.padded_vocab_size,
            "dtype": job.cfg.model.dtype,
            "written_with": {"tp": job.layout.tp, "pp": job.layout.pp, "dp": job.layout.dp, "ep": job.layout.ep},
            "source": os.path.abspath(job.source.path),
            "kind": "training",
            "lora": dataclasses.asdict(job.cfg.actor.lora) if job.cfg.actor.lora is not None else None,
        },
    )


def start_engine(cfg: MegarlConfig, spec: ModelSpec, source: ModelSource, layout: ParallelLayout, place: Placement):
    """Collective: the rollout engine, started from a directory with the HF config and tokenizer only (the weights
    arrive through the first sync)."""
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", place.world))  # the launcher's ranks per node
    engine_dir = os.path.join(cfg.trainer.output_dir, "engine")
    if place.leader:
        write_engine_dir(source.hf_config, source.tokenizer_dir, engine_dir)
    place.barrier()
    return build_engine(cfg, spec, layout, engine_dir, gpus_per_node=gpus_per_node, seed=cfg.trainer.seed, place=place)


PLACEMENT_FILE = "placement.json"


def record_placement(job: Job) -> None:
    """Collective over the launch: what each rank really built, in output_dir/placement.json (the leader writes it)
    and one line per pool in the log."""
    import json
    import socket
    import sys

    from megarl.rollout.vllm_engine import VLLMEngine  # here: vLLM is imported only on the rollout's ranks

    mine = {
        "rank": job.place.rank,
        "pool": job.place.pool.name,
        "roles": list(job.place.pool.roles),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "megatron_models": [] if job.models is None else sorted(
            n for n in ("actor", "critic", "reference", "reward_model") if getattr(job.models, n) is not None
        ),
        "megatron_initialized": "megatron.core.parallel_state" in sys.modules
        and sys.modules["megatron.core.parallel_state"].model_parallel_is_initialized(),
        "vllm_engine": isinstance(job.engine, VLLMEngine),
        "vllm_imported": "vllm" in sys.modules,
    }  # fmt: skip
    everyone = job.place.comm.all_gather_object(mine)
    if job.place.leader:
        atomic_write(os.path.join(job.cfg.trainer.output_dir, PLACEMENT_FILE), json.dumps(everyone, indent=1) + "\n")
    for p in job.place.pools:
        job.say(f"pool {p.name}: ranks {p.ranks.start}-{p.ranks.stop - 1}, roles {', '.join(p.roles)}")


def lora_identity(lora) -> dict | None:
    """What must not change when adapters resume: their rank, effective alpha and targets."""
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.effective_alpha, "target_modules": sorted(lora.target_modules)}


def _check_lora(path: str, saved_state: dict, lora, current: dict | None) -> None:
    """Adapters resume only with the same actor.lora and onto the base they were trained on (the same decision on
    every rank)."""
    saved, was = saved_state.get("lora_base"), saved_state.get("lora")
    if saved is None and current is None:
        return
    if saved is None or current is None:
        kind = "full fine-tuning" if saved is None else "LoRA adapters"
        raise ResumeError(f"{path} holds {kind} but actor.lora is {'set' if current else 'not set'}; resume it "
                          "with the same actor.lora setting, or start a new output_dir")  # fmt: skip
    if was is not None and was != lora_identity(lora):
        raise ResumeError(
            f"{path} holds adapters of rank {was['rank']}, alpha {was['alpha']:g}, targets {was['target_modules']}; "
            "actor.lora must match them to resume"
        )
    differs = same_base(saved, current)
    if differs is not None:
        raise ResumeError(
            f"{path}: its adapters were trained on another base model (model.path's {differs} differs); point "
            "model.path at the base they were trained on"
        )


def _held(path: str, name: str, step: int, what: str) -> dict | None:
    """What checkpoint ``path`` holds in ``name`` beside its trainer state (None if nothing), checked to be of
    ``step``."""
    saved = os.path.join(path, name)
    if not os.path.isfile(saved):
        return None
    try:  # plain types and tensors
        held = torch.load(saved, weights_only=True)
    except pickle.UnpicklingError:  # an environment's state_dict holds other objects: unpickled only if the file
        verify_file(path, name)  # is the one the save hashed
        held = torch.load(saved, weights_only=False)
    if held["step"] != step:
        raise ResumeError(f"{saved} holds the {what} of step {held['step']}, not of step {step}; the checkpoint is "
                          "inconsistent: resume from another one (trainer.resume=PATH)")  # fmt: skip
    return held


def read_ahead(path: str, step: int) -> Collected | None:
    """The batch a one-step-off run had generated for step ``step + 1`` when checkpoint ``path`` was saved (None if
    it holds none)."""
    held = _held(path, ROLLOUT_BATCH, step + 1, "batch")
    return None if held is None else Collected.from_dict(held["batch"])


def read_stream(path: str, step: int) -> dict | None:
    """A bounded run's rollout stream when checkpoint ``path`` (of step ``step``) was saved (None if it holds none)."""
    return _held(path, ROLLOUT_STREAM, step, "stream")


def build_job(cfg: MegarlConfig, spec: ModelSpec, source: ModelSource, engine=None) -> tuple[Job, TrainerState]:
    """Collective over the world (every rank calls it with the same config): a fresh start, or the continuation of
    the checkpoint ``trainer.resume`` names (``resume.plan_start``). ``engine``: reuse a running rollout engine of
    the same model and layout (tests run several jobs on one engine); it is synced from this job's actor."""
    place, layout, here, builds_models = join_groups(cfg)
    start, notes = verified_start(cfg, spec, place)
    notes += tidy_output_dir(cfg, place, start)
    models = None
    if builds_models:
        roles = place.pool.roles if place.pooled else ALL_ROLES
        models = build_rl_models(cfg, spec, here, source, dist.get_rank(), load_weights=start is None, roles=roles)
    lora_base = lora_fingerprint(cfg, models)
    state, rng = TrainerState(seed=cfg.trainer.seed), None
    if start is not None:
        state, rng = restore(cfg, start, models, here, lora_base, place.leader, notes)
    trim_timeline(cfg, place, state)
    ahead, stream = read_in_flight(cfg, place, start, state)
    tokenizer, sampler, val_prompts, train = prompts(cfg, source, state)
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
    if state.kl_ctrl:
        kl_ctrl.load_state_dict(state.kl_ctrl)
    offloader = Offloader(models, cfg.offload, on_gpu=torch.cuda.is_available() and not place.pooled)
    actor = models.actor if models is not None else None
    engine = start_and_sync(cfg, spec, source, layout, place, offloader, actor, state.step, engine)
    if rng is not None:
        set_rng_states(rng)  # last: starting vLLM reseeds the global generators
    tracker = open_tracker(cfg, place, state)
    rewards = None
    if place.hosts("rollout"):  # scored where the samples are generated; last
        rewards = open_rewards(cfg.reward, budget_s=cfg.reward.step_timeout_s)
    episodes = open_episodes(cfg, spec, tokenizer) if place.hosts("rollout") else None
    learners = place
    if cfg.async_training.overlapped:  # the rollout pool generates apart from the learning phases
        learners = None if place.hosts("rollout") else place.without("rollout")
    job = Job(cfg=cfg, source=source, spec=spec, layout=layout, place=place, rank=place.rank, tokenizer=tokenizer,
              sampler=sampler, val_prompts=val_prompts, rewards=rewards, models=models, engine=engine, tracker=tracker,
              kl_ctrl=kl_ctrl, skip_old_logprob=skips_old_logprob(cfg), offloader=offloader,
              roles=make_roles(cfg, spec, models, learners or place),
              phases=Phases(engine, offloader, actor, shared=not place.pooled), lora_base=lora_base,
              learners=learners, episodes=episodes)  # fmt: skip
    job.feed = make_feed(job, cfg.async_training.mode, state.step, ahead=ahead, stream=stream)
    reward_text = place.share(rewards.describe() if rewards is not None else None, "rollout")
    env_text = place.share(episodes.describe() if episodes is not None else None, "rollout")
    if env_text:
        job.say(f"environment: {env_text}")
    if place.pooled:
        record_placement(job)
    describe_job(job, train, reward_text, notes)
    return job, state


def open_episodes(cfg: MegarlConfig, spec: ModelSpec, tokenizer):
    """Multi-turn: the environments' workers and the renderer (``env.class`` set), else None."""
    if not cfg.env.enabled:
        return None
    return EpisodeRunner(cfg.env, tokenizer, max_model_len=max_model_len(cfg, spec),
                         budget_s=cfg.reward.step_timeout_s)  # fmt: skip


def join_groups(cfg: MegarlConfig) -> tuple[Placement, ParallelLayout, ParallelLayout, bool]:
    """Collective: this rank's placement (joining its pool's group with pools), the actor's layout, the layout this
    rank's models take (a critic's or reward model's pool has its own) and whether this rank builds Megatron models
    (Megatron's groups are initialised, inside the pool when pooled)."""
    par = cfg.actor.parallel
    layout = ParallelLayout.of(par)
    timeout_s = cfg.trainer.collective_timeout_s
    place = None
    if cfg.placement.pools:
        place = Placement.join(pools_of(cfg), default_backend(), timeout_s, cfg.placement.wait_timeout_s)
    layout_of = "actor" if place is None else pool_layout_role(place.pool)  # whose layout this rank's models take
    here = layout
    if layout_of not in (None, "actor"):
        par = layout_config(cfg, layout_of)
        here = ParallelLayout.of(par)
    if layout_of is not None:
        init_distributed(here, seed=cfg.trainer.seed, timeout_s=timeout_s)
    if cfg.trainer.keep_freed_memory and cpu_compat.is_installed():
        keep_freed_memory()
    return place or Placement.colocated(), layout, here, layout_of is not None


def verified_start(cfg: MegarlConfig, spec: ModelSpec, place: Placement):
    """Collective over the launch: where the run starts (``plan_start``), with every file of that checkpoint checked
    against its manifest first (sizes; SHA-256 with ``trainer.verify_checkpoint``, the hashing split over the actor's
    pool). The leader first completes a publish that a kill cut (``finish_interrupted_saves``). With
    ``trainer.resume=auto`` a damaged newest checkpoint is moved to ``checkpoints/damaged/`` and the next newest
    verified one is taken, said in one line; a damaged checkpoint that ``trainer.resume`` names is refused. Returns
    (the start, the notes to say)."""
    root = checkpoints_root(cfg.trainer.output_dir)
    notes = finish_interrupted_saves(root) if place.leader else []
    place.barrier()
    start = plan_start(cfg, spec)
    while start is not None:
        t0, error = time.perf_counter(), None
        if place.hosts("actor"):
            try:
                verify_manifest(start.path, hashes=cfg.trainer.verify_checkpoint)
            except ManifestError as e:
                error = str(e)
        error = place.share(error, "actor")
        if error is None:
            notes.append(f"verified {start.path} against its manifest in {time.perf_counter() - t0:.2f}s")
            return start, notes
        if cfg.trainer.resume != "auto":
            raise ResumeError(f"trainer.resume={cfg.trainer.resume}: {error}; resume from another checkpoint")
        damaged = start.path
        moved = place.share(set_aside(root, damaged, DAMAGED_DIR) if place.leader else None, "actor")
        if place.leader:
            point_latest(root)
        place.barrier()
        start = plan_start(cfg, spec)
        instead = f"resuming from {start.path} instead" if start else "no older checkpoint: starting over"
        notes.append(f"{damaged} is damaged ({error}): moved to {moved}; {instead}")
    return start, notes


def tidy_output_dir(cfg: MegarlConfig, place: Placement, start) -> list[str]:
    """Collective: before anything is written, the leader removes interrupted saves and the STOPPED mark, moves a
    rolled-back run's later checkpoints aside, and clears (``trainer.overwrite``) or sets aside a previous run that
    never completed a step. The notes to say."""
    out_dir = cfg.trainer.output_dir
    root = checkpoints_root(out_dir)
    interrupted = sorted(glob.glob(os.path.join(root, "iter_*.tmp*")))  # a critic pool's part too (iter_N.tmp-critic)
    explicit = cfg.trainer.resume not in ("auto", "never")  # auto takes the newest: nothing comes after it
    rolled_back = (
        explicit and start is not None and os.path.dirname(os.path.abspath(start.path)) == os.path.abspath(root)
    )
    place.barrier()  # every rank has read the checkpoints before the leader cleans up
    abandoned = []
    if place.leader:
        if rolled_back:  # resumed from an older checkpoint of this run: its later ones are another branch
            abandoned = abandon_later(root, start.step)
        if start is None and cfg.trainer.overwrite:
            clear_previous_run(out_dir)
        elif start is None and cfg.trainer.resume == "auto" and holds_previous_run(out_dir):
            aside = set_aside_previous_run(out_dir)  # it never completed a step (plan_start refuses otherwise)
            print(f"[megarl] trainer.output_dir held a run that never completed a step: its files moved to {aside}; "
                  "starting over", flush=True)  # fmt: skip
        for stale in interrupted:
            shutil.rmtree(stale, ignore_errors=True)
        if os.path.exists(os.path.join(out_dir, STOPPED_FILE)):
            os.remove(os.path.join(out_dir, STOPPED_FILE))
    place.barrier()
    notes = [f"removed an interrupted save: {d}" for d in interrupted]
    if abandoned:
        notes.append(
            f"rolled back to step {start.step}: moved the {len(abandoned)} later checkpoint(s) of the abandoned branch "
            f"to {os.path.dirname(abandoned[0])} ({', '.join(os.path.basename(p) for p in abandoned)})"
        )
    return notes


def lora_fingerprint(cfg: MegarlConfig, models: RLModels | None) -> dict | None:
    """LoRA, where the actor is trained: its frozen base's fingerprint (saved in checkpoints, checked on resume)."""
    if cfg.actor.lora is None or models is None or models.actor is None:
        return None
    return base_fingerprint(models.actor.module)


def restore(cfg: MegarlConfig, start, models: RLModels | None, here: ParallelLayout, lora_base: dict | None,
            leader: bool, notes: list[str]) -> tuple[TrainerState, dict | None]:  # fmt: skip
    """The trainer state of checkpoint ``start`` and, where this rank holds models, their weights, optimizer states
    and schedulers (RNG states: returned, set last, when the layout is the checkpoint's); what happened in ``notes``.
    The leader continues metrics.jsonl from it."""
    saved = read_trainer_state(start.path)
    state = TrainerState.from_dict(saved["state"])
    if models is None:  # the rollout's pool: where the prompts stopped
        return state, None
    trains_actor = models.actor is not None
    if trains_actor:
        _check_lora(start.path, saved, cfg.actor.lora, lora_base)
    written = saved.get("layout" if trains_actor else "critic_layout")
    same_layout = written is not None and ParallelLayout(**written) == here  # a checkpoint before EP: ep = 1
    loaded = load_training(start.path, models, verify_hashes=False, restore_rng=same_layout)  # verified_start did
    notes += [f"skipped {s}" for s in start.skipped]
    notes.append(
        f"resuming from {start.path} (step {state.step}; loaded in {loaded.seconds:.2f}s)"
    )
    if not same_layout:
        notes.append(
            f"the checkpoint was written at {ParallelLayout(**saved['layout'])}: weights, optimizer states and "
            "schedulers reshard exactly; the RNG states are per rank and do not carry to another layout (reseeded "
            "from trainer.seed); floating-point results differ from an uninterrupted run in the last bits "
            "(another reduction order)"
        )
    if leader:
        write_rows(os.path.join(cfg.trainer.output_dir, METRICS_FILE), state.history)  # continued, never duplicated
    return state, loaded.rng


def trim_timeline(cfg: MegarlConfig, place: Placement, state: TrainerState) -> None:
    """The leader: the timeline's steps after the checkpoint are dropped (they run again)."""
    timeline = os.path.join(cfg.trainer.output_dir, TIMELINE_FILE)
    if place.leader and os.path.isfile(timeline):
        write_rows(timeline, [r for r in read_metrics(timeline) if r["step"] <= state.step])


def read_in_flight(cfg: MegarlConfig, place: Placement, start, state: TrainerState):
    """Collective: on the rollout pool, the batch ahead (one-step-off) or the stream (bounded) checkpoint ``start``
    holds, (None, None) elsewhere; a checkpoint of another mode stops every pool."""
    ahead = stream = None
    if start is None:
        return ahead, stream

    def read():
        nonlocal ahead, stream
        ahead = read_ahead(start.path, state.step)
        stream = read_stream(start.path, state.step)
        mode = cfg.async_training.mode
        if stream is not None and mode != "bounded":  # the prompts in flight would be lost or skipped
            raise ResumeError(f"{start.path} holds a bounded run's rollout stream and this run's async_training."
                              f"mode is {mode}: prompts in flight do not carry across modes; resume with "
                              "mode=bounded or start elsewhere")  # fmt: skip
        if stream is None and mode == "bounded":
            raise ResumeError(f"{start.path} was saved by a run not in async_training.mode=bounded (it holds no "
                              "rollout stream): a bounded run resumes only its own checkpoints; resume with the "
                              "checkpoint's mode or start elsewhere")  # fmt: skip

    place.compute_on("rollout", read)
    return ahead, stream


def prompts(cfg: MegarlConfig, source: ModelSource, state: TrainerState):
    """The tokenizer, the training prompts' sampler (at the state's position), the validation prompts and the
    training dataset."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    train, val = _datasets(cfg, tokenizer)
    sampler = PromptSampler(train, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    sampler.load_state_dict(state.data)
    val_prompts = [] if val is None else [val[i] for i in range(min(cfg.data.val_batch_size or len(val), len(val)))]
    return tokenizer, sampler, val_prompts, train


def start_and_sync(cfg: MegarlConfig, spec: ModelSpec, source: ModelSource, layout: ParallelLayout,
                   place: Placement, offloader: Offloader, actor, version: int, engine=None):  # fmt: skip
    """Collective: the rollout engine (started, or the one passed in checked), holding the weights of ``actor`` (None
    outside its pool) as ``version`` (the first sync)."""
    if not place.pooled:  # start-up: the engine starts, and takes the first sync, with the training state the
        offloader.offload()  # offload.* flags name on the host (megarl plan's start-up phase)
    if engine is None:
        engine = start_engine(cfg, spec, source, layout, place)
    elif engine.adapter_slots != adapter_slots(cfg) or (adapter_slots(cfg) and engine.lora != cfg.actor.lora):
        raise ValueError("build_job: the engine passed in was built for another actor.lora / rollout.lora_merge")
    push_actor(engine, actor, version, resend_base=True)  # a reused engine may hold another job's base
    return engine


def open_tracker(cfg: MegarlConfig, place: Placement, state: TrainerState) -> Tracker:
    """The metrics tracker (the leader writes; W&B continues the state's run id) with the run's config.yaml."""
    tracker = Tracker(cfg.logging, cfg.trainer.output_dir, run_config=dataclasses.asdict(cfg),
                      total_steps=cfg.trainer.total_steps, enabled=place.leader, run_id=state.wandb_run_id,
                      start_step=state.step, log_every=cfg.trainer.log_every)  # fmt: skip
    tracker.write_text("config.yaml", to_yaml(cfg))
    state.wandb_run_id = tracker.run_id
    return tracker


def describe_job(job: Job, train, reward_text: str, notes: list[str]) -> None:
    """The leader: one line for the run (algorithm, model, layout, models built, rollout, prompts, reward), the
    start-up notes, and why old log-probs are computed or skipped."""
    cfg, spec, models = job.cfg, job.spec, job.models
    built = ["actor" + (" (LoRA)" if cfg.actor.lora else "")]
    built += [n for n in ("critic", "reference") if models is not None and getattr(models, n) is not None]
    built += ["reference = the actor with its adapters off"] if models is not None and models.reference_is_base else []
    limit = cfg.data.max_prompt_length
    dropped = f" ({train.dropped} longer than data.max_prompt_length={limit} dropped)" if train.dropped else ""
    job.say(
        f"{cfg.algorithm.adv_estimator} on {spec.family} {spec.num_layers}x{spec.hidden_size}, {job.layout}; "
        f"models: {', '.join(built)}; rollout: {cfg.rollout.backend} (tp {job.engine.tp}); {len(train)} train prompts"
        + dropped
        + (f", {len(job.val_prompts)} validation prompts" if job.val_prompts else "")
        + f"; reward: {reward_text}"
    )
    for note in notes:
        job.say(note)
    if job.skip_old_logprob:
        job.say("old log-probs: skipped (one mini-batch, one epoch: the policy before the update is the current one)")
    elif (why := old_logprobs_needed_by(cfg)) is not None:
        job.say(f"old log-probs: computed by the trainer before the update ({why} needs them, not the engine's)")
