"""``megarl.rl.metrics`` on a hand-made step (no ranks)."""

from types import SimpleNamespace

import torch

from megarl.backend.batch import PackStats
from megarl.config import load_config
from megarl.rl import metrics as metrics_module
from megarl.rl.collect import Collected
from megarl.rl.timer import PhaseTimer
from megarl.rollout.protocol import Sample


def _step_metrics(*overrides, kl: dict):
    cfg = load_config(None, ["model.path=x", *overrides])
    batch = Collected(samples=[Sample(0, j, [1], [5, 6], [-0.5, -0.5], "stop", [0, 0]) for j in range(2)])
    batch.scores = batch.rewards = [0.0, 1.0]
    seqs = [SimpleNamespace(tokens=[1, 5, 6])] * 2
    packed = PackStats(computed=8, real=6, micro_batches=2)  # two micro-batches of 2 x 2 positions, 1 + 2 real
    learned = SimpleNamespace(seqs=seqs, actor={"actor/pg_loss": 0.1}, critic={}, kl=kl, old_logp=None, values=None,
                              packed=packed)  # fmt: skip
    timer = PhaseTimer()
    with timer("step"):
        pass
    job = SimpleNamespace(cfg=cfg, sampler=SimpleNamespace(epoch=0))
    return metrics_module.step_metrics(job, batch, learned, timer=timer, version=0)


def test_the_kl_loss_coefficient_and_the_in_reward_one_have_their_own_names():
    both = ["actor.kl_loss_coef=0.3", "algorithm.kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.05"]
    m = _step_metrics(*both, kl={"kl/coef": 0.05, "kl/ref_mean": 0.2})
    assert m["actor/kl_coef"] == 0.3 and m["kl/coef"] == 0.05
    m = _step_metrics("actor.kl_loss_coef=0.3", kl={"kl/ref_mean": 0.2})
    assert m["actor/kl_coef"] == 0.3 and "kl/coef" not in m  # no KL in the reward: no in-reward coefficient
    assert torch.isfinite(torch.tensor(list(m.values()))).all()


def test_per_rank_metrics_across_pools_sum_bytes_and_take_each_pools_largest_times():
    """Every rank's (sums, maxes) gathered over the launch: a pool's keys are reduced over that pool's ranks."""
    ranks = [
        ({"sync/bytes_sent": 10.0}, {"sync/seconds": 1.0, "pool/train/busy_s": 3.0, "pool/train/wait_s": 0.5}),
        ({"sync/bytes_sent": 20.0}, {"sync/seconds": 2.0, "pool/train/busy_s": 4.0, "pool/train/wait_s": 0.25}),
        ({"sync/bytes_sent": 5.0}, {"sync/seconds": 1.5, "pool/rollout/busy_s": 6.0, "pool/rollout/wait_s": 4.5}),
    ]
    comm = SimpleNamespace(all_gather_object=lambda mine: ranks)
    got = metrics_module.reduce_ranks(comm, *ranks[0])
    assert got == {"sync/bytes_sent": 35.0, "sync/seconds": 2.0, "pool/train/busy_s": 4.0, "pool/train/wait_s": 0.5,
                   "pool/rollout/busy_s": 6.0, "pool/rollout/wait_s": 4.5}  # fmt: skip


def test_padding_and_micro_batches_are_logged():
    m = _step_metrics(kl={})
    assert m["perf/padding_frac"] == 0.25 and m["perf/micro_batches"] == 2.0
