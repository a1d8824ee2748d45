"""``megarl.trainer.metrics.step_metrics`` on a hand-made step (no ranks: the world reduction made local)."""

from types import SimpleNamespace

import torch

from megarl.config import load_config
from megarl.rollout.protocol import Sample
from megarl.trainer import metrics as metrics_module
from megarl.trainer.collect import Collected
from megarl.trainer.timer import PhaseTimer


def _step_metrics(monkeypatch, *overrides, kl: dict):
    monkeypatch.setattr(metrics_module.dist, "all_reduce", lambda *a, **kw: None)
    cfg = load_config(None, ["model.path=x", *overrides])
    batch = Collected(samples=[Sample(0, j, [1], [5, 6], [-0.5, -0.5], "stop", 0) for j in range(2)])
    batch.scores = batch.rewards = [0.0, 1.0]
    seqs = [SimpleNamespace(tokens=[1, 5, 6])] * 2
    learned = SimpleNamespace(seqs=seqs, actor={"actor/pg_loss": 0.1}, critic={}, kl=kl, old_logp=None, values=None)
    timer = PhaseTimer()
    with timer("step"):
        pass
    job = SimpleNamespace(cfg=cfg, sampler=SimpleNamespace(epoch=0))
    sync = SimpleNamespace(bytes_sent=0, bytes_cross_node=0, seconds=0.0)
    return metrics_module.step_metrics(job, batch, learned, sync=sync, timer=timer)


def test_the_kl_loss_coefficient_and_the_in_reward_one_have_their_own_names(monkeypatch):
    both = ["actor.kl_loss_coef=0.3", "algorithm.kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.05"]
    m = _step_metrics(monkeypatch, *both, kl={"kl/coef": 0.05, "kl/ref_mean": 0.2})
    assert m["actor/kl_coef"] == 0.3 and m["kl/coef"] == 0.05
    m = _step_metrics(monkeypatch, "actor.kl_loss_coef=0.3", kl={"kl/ref_mean": 0.2})
    assert m["actor/kl_coef"] == 0.3 and "kl/coef" not in m  # no KL in the reward: no in-reward coefficient
    assert torch.isfinite(torch.tensor(list(m.values()))).all()
