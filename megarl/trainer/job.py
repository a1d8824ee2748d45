"""Everything an RL run holds, built once on every rank: data, reward, models, the rollout engine and the tracker.

The order matters: the process groups first, then the Megatron models, then the vLLM engine (it reuses the process
group), then the first weight sync (version 0: the initial actor weights; the engine starts without weights).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch.distributed as dist

from megarl.algos import kl_controller
from megarl.config.loader import to_yaml
from megarl.config.schema import MegarlConfig
from megarl.data import Prompt, PromptDataset, PromptSampler
from megarl.logging import Tracker
from megarl.models.spec import ModelSpec
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.reshard.layout import megatron_layout
from megarl.reshard.sync import actor_tensors
from megarl.rewards import load_reward_fn
from megarl.rollout import build_engine, write_engine_dir
from megarl.trainer.models import RLModels, build_rl_models
from megarl.trainer.state import TrainerState
from megarl.training.init_weights import ModelSource

log = logging.getLogger("megarl.trainer")


@dataclass
class Job:
    """The resources of one run (a plain holder; the loop in ``loop.py`` does the work)."""

    cfg: MegarlConfig
    spec: ModelSpec
    layout: ParallelLayout
    rank: int
    tokenizer: object
    sampler: PromptSampler
    val_prompts: list[Prompt]
    reward_fn: object
    models: RLModels
    engine: object
    tracker: Tracker
    kl_ctrl: object
    skip_old_logprob: bool
    """One mini-batch and one epoch: the policy before the update is the current one, so no separate forward."""
    said_reward_error: bool = False
    """The first reward-function traceback is printed once per run."""

    def say(self, message: str) -> None:
        if self.rank == 0:
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


def skips_old_logprob(cfg: MegarlConfig) -> bool:
    one_minibatch = cfg.data.train_batch_size * cfg.rollout.sampling.n == cfg.actor.global_batch_size
    return cfg.actor.ppo_epochs == 1 and one_minibatch


def start_engine(cfg: MegarlConfig, spec: ModelSpec, source: ModelSource, layout: ParallelLayout):
    """Collective: the rollout engine, started from a directory with the HF config and tokenizer only (the weights
    arrive through the first sync)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # the launcher's ranks per node
    engine_dir = os.path.join(cfg.trainer.output_dir, "engine")
    if rank == 0:
        write_engine_dir(source.hf_config, source.tokenizer_dir, engine_dir)
    dist.barrier()
    src_layout = megatron_layout(spec, layout, gpus_per_node=gpus_per_node)
    return build_engine(cfg, spec, src_layout, engine_dir, seed=cfg.trainer.seed)


def build_job(cfg: MegarlConfig, spec: ModelSpec, source: ModelSource, state: TrainerState, engine=None) -> Job:
    """Collective over the world (every rank calls it with the same config). ``engine``: reuse a running rollout
    engine of the same model and layout (tests run several jobs on one engine); it is synced from this job's actor."""
    from transformers import AutoTokenizer

    par = cfg.actor.parallel
    layout = ParallelLayout(tp=par.tp, pp=par.pp, dp=par.dp)
    init_distributed(layout, seed=cfg.trainer.seed)
    rank = dist.get_rank()
    out_dir = cfg.trainer.output_dir

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    train, val = _datasets(cfg, tokenizer)
    sampler = PromptSampler(train, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    sampler.load_state_dict(state.data)
    val_prompts = [] if val is None else [val[i] for i in range(cfg.data.val_batch_size or len(val))]
    reward_fn = load_reward_fn(cfg.reward.function)
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
    if state.kl_ctrl:
        kl_ctrl.load_state_dict(state.kl_ctrl)

    models = build_rl_models(cfg, spec, layout, source, rank)
    if engine is None:
        engine = start_engine(cfg, spec, source, layout)
    engine.update_weights(actor_tensors(models.actor), state.step)

    tracker = Tracker(
        cfg.logging,
        out_dir,
        run_config=dataclasses.asdict(cfg),
        total_steps=cfg.trainer.total_steps,
        enabled=rank == 0,
        run_id=state.wandb_run_id,
        start_step=state.step,
        log_every=cfg.trainer.log_every,
    )
    tracker.write_text("config.yaml", to_yaml(cfg))
    state.wandb_run_id = tracker.run_id
    job = Job(
        cfg=cfg,
        spec=spec,
        layout=layout,
        rank=rank,
        tokenizer=tokenizer,
        sampler=sampler,
        val_prompts=val_prompts,
        reward_fn=reward_fn,
        models=models,
        engine=engine,
        tracker=tracker,
        kl_ctrl=kl_ctrl,
        skip_old_logprob=skips_old_logprob(cfg),
    )
    built = ["actor"] + [n for n in ("critic", "reference") if getattr(models, n) is not None]
    job.say(
        f"{cfg.algorithm.adv_estimator} on {spec.family} {spec.num_layers}x{spec.hidden_size}, {layout}; models: "
        f"{', '.join(built)}; rollout: {cfg.rollout.backend} (tp {engine.tp}); {len(train)} train prompts"
        + (
            f" ({train.dropped} longer than data.max_prompt_length={cfg.data.max_prompt_length} dropped)"
            if train.dropped
            else ""
        )
        + (f", {len(val_prompts)} validation prompts" if val_prompts else "")
    )
    if job.skip_old_logprob:
        job.say("old log-probs: skipped (one mini-batch, one epoch: the policy before the update is the current one)")
    return job
