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
    """A rejected sequence is out of the loss and its denominator: the gradient is the token mean over the others."""
    r = results["seq_mask"]
    assert r["accepted"] == [True, False, True, True, True, True]
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
