"""megarl's actor and critic gradients against an independent oracle (HF logits + the formulas in plain torch): the
composed loss, not only its invariance across layouts (tests/test_rl_update.py). See tests/rl_oracle_worker.py."""

import os
import subprocess
import sys

import pytest
import torch

from megarl.models.tiny import make_tiny_hf_model
from tests.rl_oracle_worker import ACTOR_CASES

REL = 2e-4  # fp32, two implementations: observed ~1e-6; a wrong term, sign or denominator is O(1)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl-oracle")
    hf_dir = make_tiny_hf_model(str(tmp / "llama"), "llama", seed=4, init_std=0.08)
    out = tmp / "out.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "tests.rl_oracle_worker", hf_dir, str(out)], check=True, env=env,
                   timeout=600)  # fmt: skip
    return torch.load(out, weights_only=False)


def _assert_grads_match(mine: dict, oracle: dict):
    assert mine.keys() <= oracle.keys() and len(mine) > 10
    for name, g in mine.items():
        ref = oracle[name]
        scale = ref.norm().item()
        assert scale > 0, f"{name}: the oracle's gradient is zero (degenerate input)"
        err = (g - ref).norm().item() / scale
        assert err <= REL, f"{name}: |megarl - oracle| / |oracle| = {err:.2e}"


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-6)


@pytest.mark.parametrize("case", list(ACTOR_CASES))
def test_actor_gradient_equals_the_oracle(results, case):
    r = results["actor"][case]
    _assert_grads_match(r["megarl"]["grads"], r["oracle"]["grads"])
    m, o = r["megarl"]["metrics"], r["oracle"]
    assert _close(m["actor/pg_loss"], o["pg_loss"]), (m["actor/pg_loss"], o["pg_loss"])
    assert _close(m["actor/entropy"], o["entropy"], 1e-4), (m["actor/entropy"], o["entropy"])
    if "kl_loss" in o:
        assert _close(m["actor/kl_loss"], o["kl_loss"], 1e-4), (m["actor/kl_loss"], o["kl_loss"])


ASYNC_CASES = ("async_token_truncate", "async_seq_mask", "async_seq_mask_geometric", "gspo_tis")


@pytest.mark.parametrize("case", ASYNC_CASES)
def test_the_async_cases_are_off_policy_with_weights_and_rejections(results, case):
    """lag > 0: the behaviour weights differ from 1; the seq_mask cases reject some sequences and keep others, with
    the same decision as the oracle's."""
    r = results["actor"][case]
    m = r["megarl"]["metrics"]
    assert abs(m["rollout/is_weight_mean"] - 1) > 0.05, m["rollout/is_weight_mean"]
    if "seq_mask" in case:
        assert r["megarl"]["accepted"] == r["oracle"]["accepted"]
        assert 0 < sum(r["oracle"]["accepted"]) < len(r["oracle"]["accepted"])


def test_the_inputs_reach_every_branch(results):
    """Low, high and dual clip, truncated TIS weights, a reference that differs from the policy."""
    r = results["actor"]["all_terms"]
    regions, m = r["oracle"]["regions"], r["megarl"]["metrics"]
    assert regions["high"] > 0 and regions["low"] > 0 and regions["dual"] > 0, regions
    tokens = 28
    assert _close(m["actor/pg_clipfrac"], (regions["high"] + regions["low"]) / tokens)
    assert _close(m["actor/pg_clipfrac_lower"], regions["dual"] / tokens)
    assert m["rollout/is_masked_frac"] > 0 and m["actor/kl_loss"] > 0.01
    gspo = results["actor"]["gspo"]["megarl"]["metrics"]
    assert gspo["actor/pg_clipfrac"] > 0  # sequences 0 and 1 are outside GSPO's clip range


def test_seq_mask_rejection_leaves_the_loss(results):
    """A rejected sequence is out of the loss and its denominator; the others keep their sequence weight (masked
    importance sampling): the gradient is the weighted token mean over them. GRPO's advantages (rewards 1, 0 | 0.2,
    0.9 | 0.5, 0.1 in groups of 2) are +-(difference / 2) / (|difference| / sqrt 2) = +-1/sqrt(2), by hand."""
    r = results["seq_mask"]
    assert r["accepted"] == [True, False, True, True, True, True]
    accepted_weights = [w for w, keep in zip(r["weights"], r["accepted"]) if keep]
    assert max(abs(w - 1) for w in accepted_weights) > 0.05  # weights, not a 0/1 mask
    hand = [1, -1, -1, 1, 1, -1]
    for adv, sign in zip(r["advantages"], hand):
        torch.testing.assert_close(adv, torch.full_like(adv, sign / 2**0.5), rtol=1e-4, atol=1e-5)
    _assert_grads_match(r["megarl"], r["oracle"])
    assert _close(r["metrics"]["rollout/is_rejected_seqs"], 1 / 6)
    assert _close(r["metrics"]["rollout/is_masked_frac"], 7 / 28)


def test_critic_clipped_value_loss_gradient_equals_the_oracle(results):
    r = results["critic"]
    m, o = r["megarl"], r["oracle"]
    _assert_grads_match(m["grads"], o["grads"])
    for mine, ref in zip(m["head"], o["head"]):
        assert (mine - ref).norm() <= REL * ref.norm()
    assert _close(m["metrics"]["critic/vf_loss"], o["vf_loss"])
    assert o["clipped"] > 0 and _close(m["metrics"]["critic/vf_clipfrac"], o["clipped"] / 28)


def test_a_mini_batch_with_every_sequence_rejected_takes_no_optimizer_step(results):
    """Adam + weight decay + LR warmup: rejecting every sequence of the first mini-batch leaves weights, optimizer
    state and LR schedule exactly those of an update on the second mini-batch alone."""
    skipped, without = results["empty_minibatch"]["skipped"], results["empty_minibatch"]["without"]
    assert skipped["metrics"]["empty_minibatches"] == 1 and without["metrics"]["empty_minibatches"] == 0
    assert skipped["moved"] and without["moved"]  # the second mini-batch did train
    assert all(torch.equal(a, b) for a, b in zip(skipped["weights"], without["weights"]))
    assert len(skipped["optimizer"]) == len(without["optimizer"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(skipped["optimizer"], without["optimizer"]))
    assert skipped["sched_steps"] == without["sched_steps"] == 1 and skipped["lr"] == without["lr"]
