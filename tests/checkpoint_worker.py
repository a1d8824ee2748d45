"""Run on 2 spawned ranks by tests/test_checkpoint_compat.py: the three megatron-core 0.16 distributed-optimizer
checkpoint bugs with torch's Adam, each shown with its workaround off, and a save / load / step that equals the
uninterrupted step with all of them on (TP=1 x DP=2, the distributed optimizer, fully_reshardable)."""

from __future__ import annotations

import multiprocessing.synchronize
import os
import types

import torch
import torch.distributed as dist

from megarl.backend.setup import make_scheduler, wrap_for_training
from megarl.backend.step import lm_loss, make_lm_micro_batches, train_step
from megarl.checkpoint.training import OPTIM_METADATA, _sharded_state, load_training, save_training
from megarl.compat import checkpoint_writer, megatron_fixes
from megarl.compat.cpu import megatron_mode
from megarl.config.schema import OptimConfig
from megarl.models.builder import build_model_chunk
from megarl.models.spec import read_hf_config, spec_from_hf_config
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout

OPTIM = OptimConfig(lr=1e-2, use_distributed_optimizer=True, lr_warmup_steps=2, lr_decay_style="cosine",
                    lr_decay_steps=10)  # fmt: skip


def _models(spec, layout, optim_cfg=OPTIM):
    torch.manual_seed(0)
    actor, optim = wrap_for_training(build_model_chunk(spec, layout), optim_cfg)
    return types.SimpleNamespace(actor=actor, actor_optim=optim, actor_sched=make_scheduler(optim, optim_cfg),
                                 critic=None)  # fmt: skip


def _step(models, batch, step):
    models.actor_sched.step(1)
    return train_step(models.actor, models.actor_optim, make_lm_micro_batches(batch, 1), lm_loss)["loss"]


def _weights(models):
    return {k: v.detach().clone() for k, v in models.actor.module.named_parameters()}


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # the bug's own exception, reported to the test
        return f"{type(e).__name__}: {e}"
    return "no error"


def _counting_semaphores_and_forks(save) -> dict:
    """The named semaphores (``sem_open``: a file in /dev/shm while it is created) and the forks of one ``save()``."""
    seen = {"semaphores": 0, "forks": 0}
    init = multiprocessing.synchronize.SemLock.__init__

    def counted(self, *args, **kwargs):
        seen["semaphores"] += 1
        init(self, *args, **kwargs)

    def forked():
        seen["forks"] += 1

    os.register_at_fork(before=forked)  # cannot be unregistered: counted only while `seen` is read below
    multiprocessing.synchronize.SemLock.__init__ = counted
    try:
        save()
    finally:
        multiprocessing.synchronize.SemLock.__init__ = init
    return dict(seen)


def run(hf_dir: str, root: str) -> dict:
    layout = ParallelLayout(tp=1, pp=1, dp=2)
    init_distributed(layout)
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [torch.randint(0, spec.vocab_size, (2, 17), generator=g) for _ in range(3)]

    straight = _models(spec, layout)  # the run that is never stopped: steps 1, 2, 3
    for i, b in enumerate(batches):
        _step(straight, b, i + 1)
    out = {"straight": _weights(straight)}

    saved = _models(spec, layout)  # steps 1, 2, then a checkpoint
    for i, b in enumerate(batches[:2]):
        _step(saved, b, i + 1)
    from megatron.core import dist_checkpointing

    def megatron_writer():  # megatron's own writer: forked processes joined by multiprocessing queues
        checkpoint_writer.uninstall()
        with megatron_mode():
            dist_checkpointing.save(_sharded_state(saved, loading=False, rng=True), f"{root}/megatron_writer")

    os.makedirs(f"{root}/megatron_writer", exist_ok=True)
    out["megatron_writer"] = _counting_semaphores_and_forks(megatron_writer)
    out["megarl_writer"] = _counting_semaphores_and_forks(lambda: save_training(root, 2, saved, {"step": 2}))
    path = f"{root}/iter_0000002"

    # (a) a never-stepped distributed optimizer cannot build its loading template
    fresh = _models(spec, layout)
    with megatron_mode():
        msd = fresh.actor.module.sharded_state_dict()
        out["bug_a"] = _error(
            lambda: fresh.actor_optim.sharded_state_dict(msd, is_loading=True, metadata=OPTIM_METADATA)
        )

    # (b) with (a) worked around, the parameter-state load copies 'step' (fully_reshardable: KeyError)
    def load_unpatched():
        with megatron_mode():
            state = dist_checkpointing.load(_sharded_state(fresh, loading=True, rng=False), path)
            fresh.actor_optim.load_state_dict(state["actor_optim"])

    out["bug_b"] = _error(load_unpatched)

    # (c) with (a) and (b) worked around, every parameter shares one 'step' tensor, and the next step goes wrong
    shared = _models(spec, layout)
    with megatron_mode():
        state = dist_checkpointing.load(_sharded_state(shared, loading=True, rng=False), path)
        megatron_fixes.fix_parameter_state_load(shared.actor_optim)
        shared.actor.module.load_state_dict(state["actor"], strict=False)
        shared.actor_optim.load_state_dict(state["actor_optim"])
        shared.actor_sched.load_state_dict(state["actor_sched"])
    inner = shared.actor_optim.chained_optimizers[0].optimizer
    out["bug_c_distinct_steps"] = len({id(s["step"]) for s in inner.state.values()})
    out["bug_c_params"] = len(inner.state)
    _step(shared, batches[2], 3)
    out["bug_c"] = _weights(shared)

    # all three worked around (load_training): step 3 equals the uninterrupted step 3
    resumed = _models(spec, layout)
    load_training(path, resumed, restore_rng=False)
    parts = getattr(resumed.actor_optim, "chained_optimizers", [resumed.actor_optim])
    out["fused_after_load"] = [g["fused"] for part in parts for g in part.optimizer.param_groups]
    _step(resumed, batches[2], 3)
    out["resumed"] = _weights(resumed)
    out["lr"] = (straight.actor_sched.get_lr(straight.actor_optim.param_groups[0]),
                 resumed.actor_sched.get_lr(resumed.actor_optim.param_groups[0]))  # fmt: skip
    return out


EP_OPTIM = OptimConfig(lr=1e-2, adam_eps=1e-3, use_distributed_optimizer=True)
"""Adam's first steps are ~lr * sign(g); a large eps keeps them smooth in g, so layouts compare elementwise."""


def run_expert_layouts(hf_dir: str, root: str) -> dict:
    """A Qwen3-MoE with Adam and the distributed optimizer: two steps and a save at EP=2, loaded at EP=1 (DP=2 both),
    then step 3; and the reverse. Per direction: the full weights after the load and those the saver held, and step
    3's weights against the run that never stopped."""
    from tests.parity_worker import _gather_full

    spec = spec_from_hf_config(read_hf_config(hf_dir))
    init_distributed(ParallelLayout(dp=2))
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [torch.randint(0, spec.vocab_size, (2, 17), generator=g) for _ in range(3)]
    out = {}
    for name, (first, then) in {"ep2_to_ep1": (2, 1), "ep1_to_ep2": (1, 2)}.items():
        save_at, load_at = ParallelLayout(dp=2, ep=first), ParallelLayout(dp=2, ep=then)
        init_distributed(save_at)
        models = _models(spec, save_at, EP_OPTIM)
        for i, b in enumerate(batches[:2]):
            _step(models, b, i + 1)
        save_training(f"{root}/{name}", 2, models, {"step": 2})
        saved = _gather_full(models.actor.module, save_at, spec, value_head=False)
        _step(models, batches[2], 3)
        straight = _gather_full(models.actor.module, save_at, spec, value_head=False)
        init_distributed(load_at)
        resumed = _models(spec, load_at, EP_OPTIM)
        load_training(f"{root}/{name}/iter_0000002", resumed, restore_rng=False)
        loaded = _gather_full(resumed.actor.module, load_at, spec, value_head=False)
        _step(resumed, batches[2], 3)
        out[name] = {"saved": saved, "loaded": loaded, "straight": straight,
                     "resumed": _gather_full(resumed.actor.module, load_at, spec, value_head=False)}  # fmt: skip
    return out
