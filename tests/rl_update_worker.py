"""Runs inside every spawned rank: one full RL update (the trainer's ``learn``) on fixed rollout samples, at several
layouts and micro-batch splits, reporting the metrics and the full (TP/PP-merged) actor and critic weights after it.

The reference cases are the single-rank computation: TP=PP=1 and every DP replica processes the whole batch (the
update's DP share is patched to "everything"), so the DP mean of identical gradients is the single-rank gradient.
"""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import torch
import torch.distributed as dist

from megarl.algos import kl_controller
from megarl.config.loader import load_config
from megarl.models import read_hf_config, spec_from_hf_config
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.rollout.protocol import Sample
from megarl.trainer.collect import Collected
from megarl.trainer.loop import learn
from megarl.trainer.models import build_rl_models
from megarl.trainer.timer import PhaseTimer
from megarl.training import update
from megarl.training.init_weights import model_source
from tests.parity_worker import _gather_full

ALGOS = {
    # PPO: critic + GAE, KL loss to the reference, two mini-batches (old log-probs computed), seq-mean-token-mean
    "ppo": [
        "algorithm.adv_estimator=gae",
        "algorithm.gamma=0.95",
        "algorithm.lam=0.9",
        "actor.kl_loss_coef=0.1",
        "actor.loss_agg_mode=seq-mean-token-mean",
        "actor.global_batch_size=4",
        "critic.optim.optimizer=sgd",
        "critic.optim.lr=0.5",
        "critic.optim.clip_grad=0",
    ],
    # GRPO: token-mean, entropy bonus, one mini-batch (old log-probs skipped: the loss's own forward)
    "grpo": ["algorithm.adv_estimator=grpo", "actor.entropy_coeff=0.01", "actor.global_batch_size=8"],
}
SPLITS = {"mbs2": ["actor.micro_batch_size=2", "critic.micro_batch_size=2"],
          "mbs1": ["actor.micro_batch_size=1", "critic.micro_batch_size=1"],
          "pack": ["actor.max_tokens_per_micro_batch=40", "critic.max_tokens_per_micro_batch=30"],
          "one": ["actor.micro_batch_size=64", "critic.micro_batch_size=64"]}  # fmt: skip


def fixed_batch(vocab: int) -> Collected:
    """4 prompts x 2 samples of different prompt and response lengths, with engine-like log-probs and rewards."""
    rng = random.Random(5)
    out = Collected()
    for p in range(4):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))]
        for j in range(2):
            response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
            logprobs = [-rng.uniform(4.0, 7.0) for _ in response]
            out.samples.append(Sample(p, j, prompt, response, logprobs, "stop", 0))
            out.rewards.append(rng.random())
    out.scores = list(out.rewards)
    return out


def run_case(hf_dir: str, layout: ParallelLayout, algo: str, split: str, reference: bool = False) -> dict:
    overrides = [
        f"model.path={hf_dir}",
        f"actor.parallel.tp={layout.tp}",
        f"actor.parallel.pp={layout.pp}",
        f"actor.parallel.dp={layout.dp}",
        "actor.optim.optimizer=sgd",
        "actor.optim.lr=2.0",
        "actor.optim.clip_grad=0",
        "rollout.sampling.n=2",
        "rollout.sampling.temperature=0.9",
        "data.train_batch_size=4",
        *ALGOS[algo],
        *SPLITS[split],
    ]
    cfg = load_config(None, overrides)
    spec = spec_from_hf_config(read_hf_config(hf_dir))
    init_distributed(layout, seed=1)
    models = build_rl_models(cfg, spec, layout, model_source(hf_dir), dist.get_rank())
    skip = cfg.actor.global_batch_size == 8
    kl = kl_controller("fixed", 0.0, 0.1, 1000)
    everything = mock.patch.object(update, "_dp_coords", lambda: (0, 1)) if reference else contextlib.nullcontext()
    with everything:
        learned = learn(cfg, spec, models, fixed_batch(spec.vocab_size), kl_ctrl=kl, skip_old_logprob=skip,
                        timer=PhaseTimer())  # fmt: skip
    if reference:  # every DP replica reported the whole batch's sums: the real DP group summed them dp times
        for metrics in (learned.actor, learned.critic):
            for k in metrics:
                if k not in ("grad_norm", "lr") and not k.startswith("max/"):
                    metrics[k] /= layout.dp
    out = {
        "actor": learned.actor,
        "critic": learned.critic,
        "advantages": torch.cat(learned.advantages),
        "weights": _gather_full(models.actor.module, layout, spec, value_head=False),
    }
    if models.critic is not None:
        out["critic_weights"] = _gather_full(models.critic.module, layout, spec, value_head=True)
    if algo == "ppo" and reference and split == "mbs2":
        from megarl.models.builder import build_model_chunk
        from megarl.training.init_weights import load_initial_weights

        initial = build_model_chunk(spec, layout, init_weights=False)
        load_initial_weights(initial, model_source(hf_dir), spec, layout, dist.get_rank())
        out["initial"] = _gather_full(initial, layout, spec, value_head=False)
    return out


def tp_attribute_bug(hf_dir: str) -> dict:
    """megatron-core 0.16: a model built without random init lacks TP attributes; megarl's builder restores them."""
    from megarl.compat.megatron_fixes import restore_tp_attributes
    from megarl.models.builder import build_model_chunk

    spec = spec_from_hf_config(read_hf_config(hf_dir))
    layout = ParallelLayout(tp=dist.get_world_size())
    init_distributed(layout, seed=1)
    with mock.patch("megarl.models.builder.restore_tp_attributes", lambda model: 0):
        raw = build_model_chunk(spec, layout, init_weights=False)
    flags = lambda m: {n: hasattr(p, "tensor_model_parallel") for n, p in m.named_parameters() if "layernorm" not in n}
    before = flags(raw)
    restored = restore_tp_attributes(raw)
    return {"before": before, "after": flags(raw), "restored": restored,
            "builder": flags(build_model_chunk(spec, layout, init_weights=False))}  # fmt: skip


def run_cases(hf_dir: str, cases: list[tuple[str, dict]]) -> dict:
    out = {name: run_case(hf_dir, **kwargs) for name, kwargs in cases}
    out["tp_attribute_bug"] = tp_attribute_bug(hf_dir)
    return out
