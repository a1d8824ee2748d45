"""megarl.algos: hand-computed cases plus comparisons with plain Python-loop references on ragged random batches."""

import math
import random

import pytest
import torch

from megarl.algos import (
    AdaptiveKLController,
    FixedKLController,
    aggregate,
    broadcast_to_tokens,
    gae,
    grpo,
    gspo_policy_loss,
    kl_controller,
    kl_estimate,
    kl_loss_terms,
    kl_penalty_rewards,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
    rollout_is_weights,
    token_level_scores,
    value_loss,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from megarl.algos.sampling import Truncation

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=1e-5)


def response_mask(lengths, width):
    """[N, R] mask, contiguous from position 0 with the given lengths."""
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()


def span_mask(spans, width):
    """[B, T] mask that is 1 on [start, stop) of each row (the response may start anywhere in a micro-batch row)."""
    pos = torch.arange(width)[None, :]
    starts, stops = (torch.tensor(s)[:, None] for s in zip(*spans))
    return ((pos >= starts) & (pos < stops)).float()


def garbage_outside(x, mask, value=float("nan")):
    """x with ``value`` outside the mask: results must not depend on padding."""
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def rows(t):
    return t.tolist()


# ---------------------------------------------------------------------------------------------------- masked stats


def ref_masked_stats(x, mask):
    vals = [v for xr, mr in zip(rows(x), rows(mask)) for v, m in zip(xr, mr) if m]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, var


def test_masked_stats_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    x = garbage_outside(x, mask)
    # masked entries 1, 2, 3, 4: mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5
    close(masked_mean(x, mask), 2.5)
    close(masked_mean(x, mask, dim=-1), [2.0, 4.0])
    close(masked_var(x, mask), 5 / 3)
    close(masked_var(x, mask, unbiased=False), 1.25)
    # whiten: (x - 2.5) / sqrt(5/3) = [-1.5, -0.5, 0.5, 1.5] / 1.2909944
    white = masked_whiten(x, mask)
    close(white, [[-1.161895, -0.387298, 0.387298], [1.161895, 0.0, 0.0]])
    close(masked_whiten(x, mask, shift_mean=False), [[1.338105, 2.112702, 2.887298], [3.661895, 0.0, 0.0]])
    assert white.dtype == torch.float32


def test_masked_stats_vs_loop():
    torch.manual_seed(0)
    mask = response_mask([5, 1, 3, 7, 2], 7)
    x = torch.randn(5, 7) * 3 + 1
    mean, var = ref_masked_stats(x, mask)
    close(masked_mean(x, mask), mean)
    close(masked_var(x, mask), var)
    expected = [
        [(v - mean) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(xr, mr)]
        for xr, mr in zip(rows(x), rows(mask))
    ]
    close(masked_whiten(x, mask), expected)
    row_means = [sum(v for v, m in zip(xr, mr) if m) / sum(mr) for xr, mr in zip(rows(x), rows(mask))]
    close(masked_mean(x, mask, dim=1), row_means)


# ---------------------------------------------------------------------------------------------------- GAE


def ref_gae(rewards, values, mask, gamma, lam):
    advs, rets = [], []
    for r, v, m in zip(rows(rewards), rows(values), rows(mask)):
        n = int(sum(m))
        adv, nxt = [0.0] * len(m), 0.0
        for t in reversed(range(n)):
            v_next = v[t + 1] if t + 1 < n else 0.0
            nxt = r[t] + gamma * v_next - v[t] + gamma * lam * nxt
            adv[t] = nxt
        advs.append(adv)
        rets.append([a + v[t] if t < n else 0.0 for t, a in enumerate(adv)])
    return torch.tensor(advs), torch.tensor(rets)


def test_gae_hand():
    mask = response_mask([3, 2], 3)
    rewards = garbage_outside(torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.5, 0.0]]), mask, 9.0)
    values = garbage_outside(torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 0.0]]), mask, 9.0)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # row 0: d2 = 1 - 0.7 = 0.3; d1 = 0.9*0.7 - 0.6 = 0.03; d0 = 0.9*0.6 - 0.5 = 0.04
    #        A2 = 0.3; A1 = 0.03 + 0.72*0.3 = 0.246; A0 = 0.04 + 0.72*0.246 = 0.21712
    # row 1: d1 = 0.5 - 0.4 = 0.1 (V after the last token is 0, not the padding's 9); d0 = 1 + 0.9*0.4 - 0.2 = 1.16
    #        A1 = 0.1; A0 = 1.16 + 0.72*0.1 = 1.232
    close(adv, [[0.21712, 0.246, 0.3], [1.232, 0.1, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [1.432, 0.5, 0.0]])


def test_gae_vs_loop():
    torch.manual_seed(1)
    mask = response_mask([6, 1, 4, 0, 3], 6)
    rewards, values = torch.randn(5, 6), torch.randn(5, 6)
    exp_adv, exp_ret = ref_gae(rewards, values, mask, 0.95, 0.9)
    adv, ret = gae(garbage_outside(rewards, mask), garbage_outside(values, mask), mask, 0.95, 0.9, whiten=False)
    close(adv, exp_adv)
    close(ret, exp_ret)
    white, ret2 = gae(rewards, values, mask, 0.95, 0.9)
    close(white, masked_whiten(exp_adv, mask))
    close(ret2, exp_ret)  # returns are never whitened
    assert (white[mask == 0] == 0).all()


# ---------------------------------------------------------------------------------------------------- group baselines


def ref_groups(group):
    out = {}
    for i, g in enumerate(group.tolist()):
        out.setdefault(g, []).append(i)
    return out.values()


def ref_grpo(scores, group, norm_by_std, eps=1e-6):
    adv = [0.0] * len(scores)
    for idx in ref_groups(group):
        s = scores[idx]
        mean, std = (s.double().mean().item(), s.double().std().item()) if len(idx) > 1 else (0.0, 1.0)
        for i in idx:
            adv[i] = (scores[i].item() - mean) / (std + eps) if norm_by_std else scores[i].item() - mean
    return torch.tensor(adv)


def test_grpo_hand():
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0])
    group = torch.tensor([7, 7, 3, 7])  # ids, not positions: group 7 = rows 0, 1, 3; group 3 = row 2 alone
    # group 7: scores 1, 0, 1 -> mean 2/3, unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3, std 0.5773503
    # alone: mean 0, std 1 -> the raw score 0.5
    close(
        grpo(scores, group),
        [(1 / 3) / (0.5773503 + 1e-6), (-2 / 3) / (0.5773503 + 1e-6), 0.5 / (1 + 1e-6), (1 / 3) / (0.5773503 + 1e-6)],
    )
    close(grpo(scores, group), [0.577349, -1.154698, 0.5, 0.577349])
    close(grpo(scores, group, norm_by_std=False), [1 / 3, -2 / 3, 0.5, 1 / 3])


def test_grpo_uniform_group_is_zero():
    adv = grpo(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 1, 1]))
    close(adv, torch.zeros(5))
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_vs_loop(norm_by_std):
    torch.manual_seed(2)
    group = torch.tensor([3, 0, 3, 1, 0, 3, 2, 0, 1, 1, 1])
    scores = torch.randn(len(group))
    close(grpo(scores, group, norm_by_std=norm_by_std), ref_grpo(scores, group, norm_by_std))


def ref_rloo(scores, group):
    adv = scores.tolist()
    for idx in ref_groups(group):
        for i in idx:
            if len(idx) > 1:
                adv[i] = scores[i].item() - sum(scores[j].item() for j in idx if j != i) / (len(idx) - 1)
    return torch.tensor(adv)


def test_rloo_hand():
    # group 0: 1, 0, 1 -> 1 - (0+1)/2 = 0.5, 0 - (1+1)/2 = -1, 0.5; group 1 of one keeps its score 2
    close(rloo(torch.tensor([1.0, 0.0, 1.0, 2.0]), torch.tensor([0, 0, 0, 1])), [0.5, -1.0, 0.5, 2.0])


def test_rloo_vs_loop():
    torch.manual_seed(3)
    group = torch.tensor([5, 5, 2, 9, 2, 5, 2, 2])
    scores = torch.randn(len(group))
    close(rloo(scores, group), ref_rloo(scores, group))


# ---------------------------------------------------------------------------------------------------- REINFORCE++


def ref_return_to_go(rewards, mask, gamma):
    out = []
    for r, m in zip(rows(rewards), rows(mask)):
        n = int(sum(m))
        row = [0.0] * len(m)
        for t in range(n):
            row[t] = sum(gamma ** (k - t) * r[k] for k in range(t, n))
        out.append(row)
    return torch.tensor(out)


def test_reinforce_pp_hand():
    mask = response_mask([3, 1], 3)
    rewards = garbage_outside(torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]]), mask, 5.0)
    adv, ret = reinforce_pp(rewards, mask, gamma=0.5)
    # row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5; row 1: G0 = 3
    close(ret, [[1.5, 1.0, 2.0], [3.0, 0.0, 0.0]])
    # whiten 1.5, 1, 2, 3: mean 1.875, unbiased var 2.1875 / 3 = 0.7291667, std 0.8539126
    close(adv, [[-0.439155, -1.024695, 0.146385], [1.317465, 0.0, 0.0]])


def test_reinforce_pp_vs_loop():
    torch.manual_seed(4)
    mask = response_mask([4, 2, 5, 1], 5)
    rewards = torch.randn(4, 5)
    adv, ret = reinforce_pp(garbage_outside(rewards, mask), mask, gamma=0.9)
    expected = ref_return_to_go(rewards, mask, 0.9)
    close(ret, expected)
    mean, var = ref_masked_stats(expected, mask)
    close(
        adv,
        [
            [(v - mean) / math.sqrt(var) if m else 0.0 for v, m in zip(er, mr)]
            for er, mr in zip(rows(expected), rows(mask))
        ],
    )


def test_reinforce_pp_baseline_hand():
    mask = response_mask([1, 1, 2], 3)
    adv = reinforce_pp_baseline(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0, 0, 1]), mask)
    # centred: 0.5, -0.5, 0 (alone: its own mean); tokens 0.5, -0.5, 0, 0: mean 0, var 0.5/3, std 0.4082483
    close(adv, [[1.224745, 0.0, 0.0], [-1.224745, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_reinforce_pp_baseline_vs_loop():
    torch.manual_seed(5)
    group = torch.tensor([0, 1, 0, 1, 1, 2])
    mask = response_mask([3, 1, 4, 2, 4, 2], 4)
    scores = torch.randn(6)
    centred = [0.0] * 6
    for idx in ref_groups(group):
        for i in idx:
            centred[i] = scores[i].item() - sum(scores[j].item() for j in idx) / len(idx)
    tokens = torch.tensor([[centred[i] * m for m in mr] for i, mr in enumerate(rows(mask))])
    mean, var = ref_masked_stats(tokens, mask)
    expected = [
        [(v - mean) / math.sqrt(var) if m else 0.0 for v, m in zip(tr, mr)] for tr, mr in zip(rows(tokens), rows(mask))
    ]
    close(reinforce_pp_baseline(scores, group, mask), expected)


# ---------------------------------------------------------------------------------------------------- token placement


def test_broadcast_to_tokens():
    mask = response_mask([2, 0, 3], 3)
    close(broadcast_to_tokens(torch.tensor([0.5, 7.0, -1.0]), mask), [[0.5, 0.5, 0.0], [0, 0, 0], [-1.0, -1.0, -1.0]])
    torch.manual_seed(6)
    adv, mask = torch.randn(4), response_mask([1, 4, 2, 3], 4)
    close(broadcast_to_tokens(adv, mask), [[a * m for m in mr] for a, mr in zip(adv.tolist(), rows(mask))])


def test_token_level_scores():
    mask = response_mask([2, 0, 3], 3)
    close(token_level_scores(torch.tensor([0.5, 7.0, -1.0]), mask), [[0.0, 0.5, 0.0], [0, 0, 0], [0.0, 0.0, -1.0]])
    torch.manual_seed(7)
    lengths = [3, 1, 5, 2]
    scores, mask = torch.randn(4), response_mask(lengths, 5)
    expected = [[s if t == n - 1 else 0.0 for t in range(5)] for s, n in zip(scores.tolist(), lengths)]
    close(token_level_scores(scores, mask), expected)


# ---------------------------------------------------------------------------------------------------- KL


def test_kl_estimators_hand():
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    close(kl_estimate(logp, ref, "k1"), [math.log(2)])  # 0.693147
    close(kl_estimate(logp, ref, "k2"), [0.5 * math.log(2) ** 2])  # 0.240227
    k3 = kl_estimate(logp, ref, "k3")  # r = ref - logp = -log 2: exp(r) - r - 1 = 0.5 + 0.693147 - 1 = 0.193147
    close(k3, [0.193147])
    (grad,) = torch.autograd.grad(k3.sum(), logp)  # d/dlogp = 1 - exp(r) = 0.5
    close(grad, [0.5])
    close(kl_estimate(torch.tensor([-30.0]), torch.tensor([0.0]), "k3"), [10.0])  # clamped
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        kl_estimate(logp, ref, "k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_vs_loop(kind):
    torch.manual_seed(8)
    logp, ref = -torch.rand(20) * 3, -torch.rand(20) * 3
    formulas = {
        "k1": lambda a, b: a - b,
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: min(max(math.exp(b - a) - (b - a) - 1, -10), 10),
    }
    close(kl_estimate(logp, ref, kind), [formulas[kind](a, b) for a, b in zip(logp.tolist(), ref.tolist())])


def test_kl_penalty_rewards_hand():
    mask = response_mask([3, 2], 3)
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    ref = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]])
    logp = garbage_outside(ref + 0.1, mask, 4.0)  # k1 = 0.1 on every real token; padding carries no penalty
    rewards, kl_mean = kl_penalty_rewards(scores, logp, ref, mask, coef=0.5, kind="k1")
    close(rewards, [[-0.05, -0.05, 0.95], [-0.05, 1.95, 0.0]])
    assert kl_mean == pytest.approx(0.1, abs=1e-6)


def test_kl_penalty_rewards_vs_loop():
    torch.manual_seed(9)
    mask = response_mask([4, 1, 3], 4)
    scores, logp, ref = torch.randn(3, 4), -torch.rand(3, 4), -torch.rand(3, 4)
    rewards, kl_mean = kl_penalty_rewards(scores, logp, ref, mask, coef=0.3, kind="k2")
    kls = [
        [0.5 * (a - b) ** 2 * m for a, b, m in zip(ar, br, mr)] for ar, br, mr in zip(rows(logp), rows(ref), rows(mask))
    ]
    close(rewards, [[s - 0.3 * k for s, k in zip(sr, kr)] for sr, kr in zip(rows(scores), kls)])
    lengths = [4, 1, 3]  # the adaptive controller sees the mean of per-sequence means (verl), not the token mean
    assert kl_mean == pytest.approx(sum(sum(k) / n for k, n in zip(kls, lengths)) / 3, rel=1e-5)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_have_finite_gradients_at_extreme_log_ratios(kind):
    """|log-ratio| = 100 (a prompt or padding position's log-prob against a reference of 0): exp(100) overflows
    float32; the gradient must stay finite (k3 clamps the log-ratio to +-20 before exp, as verl)."""
    logp = torch.tensor([-100.0, 100.0, -0.5], requires_grad=True)
    ref = torch.tensor([0.0, 0.0, -0.4])
    (grad,) = torch.autograd.grad(kl_estimate(logp, ref, kind).sum(), logp)
    assert torch.isfinite(grad).all(), grad


def _categorical_expected_kl_loss_gradient(kind: str, sampler_shift: float) -> dict[str, torch.Tensor]:
    """A categorical policy pi = softmax(theta) over 7 tokens, every token enumerated: the exact expectation over
    tokens drawn from pi_old = softmax(theta + shift) (pi itself at shift 0) of the gradient of the ``kind`` KL loss,
    beside the analytic gradients of KL(pi || ref) and KL(ref || pi)."""
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(7, generator=gen, dtype=torch.float64).requires_grad_()
    ref = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), -1)
    shift = sampler_shift * torch.randn(7, generator=gen, dtype=torch.float64)
    old = torch.log_softmax(theta.detach() + shift, -1)
    logp = torch.log_softmax(theta, -1)
    expected = (old.exp() * kl_loss_terms(logp, ref, old, kind).double()).sum()  # the sampler's law: no gradient
    (grad,) = torch.autograd.grad(expected, theta, retain_graph=True)
    forward = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta, retain_graph=True)[0]
    reverse = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta)[0]
    return {"grad": grad, "forward": forward, "reverse": reverse}


@pytest.mark.parametrize("sampler_shift", [0.0, 0.7])
def test_kl_losses_expected_gradients_on_a_categorical_policy(sampler_shift):
    """Tang & Munos (2025): on pi's samples E[grad k2] = grad KL(pi||ref) and E[grad k3] = grad KL(ref||pi) (reverse);
    k3_is = (pi/pi_old) k3 gives grad KL(pi||ref) on pi_old's samples too, where k2 does not."""
    k3_is = _categorical_expected_kl_loss_gradient("k3_is", sampler_shift)
    assert k3_is["forward"].norm() > 0.1 and (k3_is["forward"] - k3_is["reverse"]).norm() > 0.1  # not degenerate
    torch.testing.assert_close(k3_is["grad"], k3_is["forward"], rtol=1e-5, atol=1e-6)  # float32 inside
    k2 = _categorical_expected_kl_loss_gradient("k2", sampler_shift)
    k3 = _categorical_expected_kl_loss_gradient("k3", sampler_shift)
    if sampler_shift == 0:
        torch.testing.assert_close(k2["grad"], k2["forward"], rtol=1e-5, atol=1e-6)  # float32 inside
        torch.testing.assert_close(k3["grad"], k3["reverse"], rtol=1e-5, atol=1e-6)  # float32 inside
    else:  # off-policy samples: only the weighted estimator keeps the forward KL's gradient
        assert (k2["grad"] - k2["forward"]).norm() > 0.05 * k2["forward"].norm()


def _far_reference(dtype=torch.float64):
    """pi = softmax(theta) over 7 tokens and a reference 20x above it on token 0 (log-ratio r = ref - logp = log 20
    = 3.0 > 2.611, where the old k3 clamp at 10 binds), the other tokens' mass scaled down to sum to 1."""
    theta = torch.tensor([-3.0, 0.5, 0.1, -0.4, 0.9, -0.2, 0.3], dtype=dtype).requires_grad_()
    pi = torch.softmax(theta.detach(), -1)
    assert pi[0] < 1 / 20
    ref = pi * (1 - 20 * pi[0]) / (1 - pi[0])
    ref[0] = 20 * pi[0]
    return theta, ref.log()


def test_k3_is_expected_gradient_holds_where_the_reference_is_far_above_the_policy():
    """A reference 20x above pi on one token: E_pi[grad k3_is] = grad KL(pi || ref) and E_pi[grad k3] =
    grad KL(ref || pi), by exact enumeration; the far token's own coefficient on grad log pi is log(pi/ref) = -log 20
    (a clamped k3 left only the ratio's +10 there: the expected gradient's sign flipped)."""
    theta, ref = _far_reference()
    logp = torch.log_softmax(theta, -1)
    old = logp.detach()
    for kind, exact in (("k3_is", (logp.exp() * (logp - ref)).sum()), ("k3", (ref.exp() * (ref - logp)).sum())):
        expected = (old.exp() * kl_loss_terms(logp, ref, old, kind).double()).sum()
        (grad,) = torch.autograd.grad(expected, theta, retain_graph=True)
        (want,) = torch.autograd.grad(exact, theta, retain_graph=True)
        assert want.norm() > 0.01
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7)  # float32 inside
    leaf = logp.detach().clone().requires_grad_()
    (coef,) = torch.autograd.grad(kl_loss_terms(leaf, ref, old, "k3_is")[0], leaf)
    assert coef[0].item() == pytest.approx(-math.log(20), rel=1e-5)


def test_kl_losses_have_finite_gradients_at_extreme_log_ratios():
    logp = torch.tensor([-100.0, 100.0, -0.5], requires_grad=True)
    ref = torch.tensor([0.0, 0.0, -0.4])
    for kind in ("k2", "k3", "k3_is"):
        (grad,) = torch.autograd.grad(kl_loss_terms(logp, ref, logp.detach(), kind).sum(), logp)
        assert torch.isfinite(grad).all(), (kind, grad)
        assert grad[0] < 0 and grad[1] > 0, (kind, grad)  # toward the reference on both sides


@pytest.mark.parametrize("divergence", [0.003, 0.03])
def test_k3_is_weighted_by_the_behaviour_policy_gives_the_forward_kl_gradient_off_policy(divergence):
    """The async modes: tokens drawn from mu (older weights) while pi_old is the proximal policy, pi != pi_old != mu.
    Weighted by pi_old / mu, E_mu[grad k3_is] = grad KL(pi || ref) exactly; unweighted it is off by a few percent
    (the review's 7% at a per-token KL(mu || pi_old) of 0.003)."""
    gen = torch.Generator().manual_seed(5)
    theta = torch.randn(7, generator=gen, dtype=torch.float64).requires_grad_()
    ref = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    old = torch.log_softmax(theta.detach() + 0.3 * torch.randn(7, generator=gen, dtype=torch.float64), -1)
    direction = torch.randn(7, generator=gen, dtype=torch.float64)
    def behaviour(s: float) -> torch.Tensor:
        return torch.log_softmax(old + s * direction, -1)

    low, high = 0.0, 10.0
    for _ in range(60):  # mu = softmax(old + s d) with KL(mu || pi_old) = divergence: bisection on s
        mid = (low + high) / 2
        mu = behaviour(mid)
        low, high = (mid, high) if (mu.exp() * (mu - old)).sum() < divergence else (low, mid)
    mu = behaviour(low)
    assert (mu.exp() * (mu - old)).sum().item() == pytest.approx(divergence, rel=1e-6)
    (want,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta, retain_graph=True)
    weighted = (mu.exp() * kl_loss_terms(logp, ref, old, "k3_is", behaviour_logp=mu).double()).sum()
    (grad,) = torch.autograd.grad(weighted, theta, retain_graph=True)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)  # float32 inside
    unweighted = (mu.exp() * kl_loss_terms(logp, ref, old, "k3_is").double()).sum()
    (off,) = torch.autograd.grad(unweighted, theta)
    assert (off - want).norm() > 0.02 * want.norm()
    capped = kl_loss_terms(logp, ref, old, "k3_is", behaviour_logp=old - 5.0, cap=2.0)
    torch.testing.assert_close(capped, 2.0 * kl_loss_terms(logp, ref, old, "k3_is"))  # the rollout IS cap


def test_k1_is_refused_as_a_kl_loss_and_its_expected_gradient_is_zero():
    gen = torch.Generator().manual_seed(4)
    theta = torch.randn(7, generator=gen, dtype=torch.float64).requires_grad_()
    ref = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    (grad,) = torch.autograd.grad((logp.exp().detach() * kl_estimate(logp, ref, "k1").double()).sum(), theta)
    assert grad.abs().max() < 1e-7  # 0 up to float32 rounding (gradients of KL are O(0.1) here)
    with pytest.raises(ValueError, match="expected gradient 0"):
        kl_loss_terms(logp, ref, logp.detach(), "k1")


def test_kl_controllers():
    ctrl = kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=0.06, n_steps=10)  # err = 0.06/0.05 - 1 = 0.2: value = 0.1 * (1 + 0.2 * 10/100) = 0.102
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.045, n_steps=10)  # err = -0.1: value = 0.102 * (1 - 0.01) = 0.10098
    assert ctrl.value == pytest.approx(0.10098)
    ctrl.update(current_kl=1.0, n_steps=10)  # err = 19 clipped to 0.2: value = 0.10098 * 1.02 = 0.1029996
    assert ctrl.value == pytest.approx(0.1029996)
    state = ctrl.state_dict()
    assert state == {"value": pytest.approx(0.1029996)} and all(type(v) is float for v in state.values())
    fresh = kl_controller("adaptive", kl_coef=0.1, target_kl=0.05, horizon=100)
    fresh.load_state_dict(state)
    assert fresh.value == ctrl.value

    fixed = kl_controller("fixed", kl_coef=0.2, target_kl=0.05, horizon=100)
    assert isinstance(fixed, FixedKLController) and not isinstance(fixed, AdaptiveKLController)
    fixed.update(current_kl=5.0, n_steps=1000)
    assert fixed.value == 0.2
    with pytest.raises(ValueError, match="adaptive"):
        kl_controller("pid", kl_coef=0.2, target_kl=0.05, horizon=100)


# ---------------------------------------------------------------------------------------------------- aggregation


def ref_aggregate(loss, mask, mode, norm_len=None):
    per_row = [[v for v, m in zip(lr, mr) if m] for lr, mr in zip(rows(loss), rows(mask))]
    tokens, seqs = sum(map(len, per_row)), len(per_row)
    return {
        "token-mean": lambda: sum(map(sum, per_row)) / tokens,
        "seq-mean-token-sum": lambda: sum(map(sum, per_row)) / seqs,
        "seq-mean-token-mean": lambda: sum(sum(r) / max(len(r), 1) for r in per_row) / seqs,
        "seq-mean-token-sum-norm": lambda: sum(map(sum, per_row)) / (seqs * norm_len),
    }[mode]()


def test_aggregate_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    kw = dict(global_tokens=4, global_seqs=2)
    close(aggregate(loss, mask, "token-mean", **kw), 4.0)  # (1 + 4 + 5 + 6) / 4
    close(aggregate(loss, mask, "seq-mean-token-sum", **kw), 8.0)  # (1 + 15) / 2
    close(aggregate(loss, mask, "seq-mean-token-mean", **kw), 3.0)  # (1/1 + 15/3) / 2
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=4, **kw), 2.0)  # 16 / (2 * 4)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(loss, mask, "seq-mean-token-sum-norm", **kw)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(loss, mask, "sum", **kw)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_split_over_micro_batches_and_ranks(mode):
    rng = random.Random(10)
    torch.manual_seed(10)
    n_rows, width = 12, 9
    spans = [(s, rng.randint(s + 1, width)) for s in (rng.randint(0, width - 1) for _ in range(n_rows))]
    mask = span_mask(spans, width)
    loss = garbage_outside(torch.randn(n_rows, width), mask).requires_grad_()
    kw = dict(global_tokens=int(mask.sum()), global_seqs=n_rows, norm_len=width)
    whole = aggregate(loss, mask, mode, **kw)
    close(whole, ref_aggregate(loss.detach(), mask, mode, norm_len=width))
    (whole_grad,) = torch.autograd.grad(whole, loss)

    order = list(range(n_rows))
    rng.shuffle(order)
    ranks = [order[: n_rows // 2], order[n_rows // 2 :]]  # 2 simulated DP ranks, each split into micro-batches
    total = 0.0
    for rank_rows in ranks:
        cuts = sorted(rng.sample(range(1, len(rank_rows)), 2))
        for mb in (rank_rows[: cuts[0]], rank_rows[cuts[0] : cuts[1]], rank_rows[cuts[1] :]):
            total = total + aggregate(loss[mb], mask[mb], mode, **kw)
    close(total, whole)
    (split_grad,) = torch.autograd.grad(total, loss)
    close(split_grad, whole_grad)
    assert torch.isfinite(split_grad).all() and (split_grad[mask == 0] == 0).all()


# ---------------------------------------------------------------------------------------------------- policy losses


def ref_ppo(logp, old, adv, clip_low, clip_high, clip_c):
    out = {k: [] for k in ("loss", "clipped", "dual_clipped", "ratio")}
    for lp, o, a in zip(logp.flatten().tolist(), old.flatten().tolist(), adv.flatten().tolist()):
        ratio = math.exp(lp - o)
        l1, l2 = -a * ratio, -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
        loss, dual = max(l1, l2), 0.0
        if a < 0 and -a * clip_c < loss:
            loss, dual = -a * clip_c, 1.0
        for k, v in zip(out, (loss, float(l2 > l1), dual, ratio)):
            out[k].append(v)
    return {k: torch.tensor(v).view(logp.shape) for k, v in out.items()}


def test_ppo_hand_clip_higher_and_dual_clip():
    ratio = torch.tensor([[1.5, 1.25, 0.7, 5.0, 2.0, 5.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    logp = ratio.log().requires_grad_()
    old = torch.zeros_like(ratio)
    out = ppo_policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    # A>0, r=1.5: only the high clip binds -> -1.28. A>0, r=1.25: inside [0.8, 1.28] (a symmetric 0.2 would clip).
    # A<0, r=0.7: only the low clip binds -> max(0.7, 0.8) = 0.8. A<0, r=5: max(5, 1.28) = 5 > 3 -> dual bound 3.
    # A<0, r=2: max(2, 1.28) = 2 < 3, no dual clip. A>0, r=5: high clip -1.28 (dual clip only for A<0).
    close(out["loss"], [[-1.28, -1.25, 0.8, 3.0, 2.0, -1.28]])
    close(out["clipped"], [[1, 0, 1, 0, 0, 1]])
    close(out["dual_clipped"], [[0, 0, 0, 1, 0, 0]])
    close(out["ratio"], ratio)
    close(out["approx_kl"], -ratio.log())
    (grad,) = torch.autograd.grad(out["loss"].sum(), logp)
    # d(-A r)/dlogp = -A r where the unclipped term is taken, 0 where a clip bound is
    close(grad, [[0.0, -1.25, 0.0, 0.0, 2.0, 0.0]])


def test_ppo_vs_loop():
    torch.manual_seed(11)
    logp, old, adv = -torch.rand(4, 6) * 2, -torch.rand(4, 6) * 2, torch.randn(4, 6)
    out = ppo_policy_loss(logp, old, adv, clip_low=0.2, clip_high=0.3, clip_c=2.5)
    expected = ref_ppo(logp, old, adv, 0.2, 0.3, 2.5)
    for key in expected:
        close(out[key], expected[key])
    assert out["clipped"].sum() > 0 and out["dual_clipped"].sum() > 0  # the random case exercises both bounds


def test_gspo_hand():
    mask = torch.tensor([[1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    logp = garbage_outside(old + torch.tensor([[0.1, 0.3, 0.0]]), mask, 50.0)  # padding would swamp an unmasked mean
    adv = torch.ones(1, 3)
    # s = exp(mean(0.1, 0.3)) = exp(0.2) = 1.2214028 on every token
    out = gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    close(out["ratio"], [[1.2214028] * 3])
    close(out["loss"], [[-1.2] * 3])  # clipped at 1 + 0.2
    close(out["clipped"], [[1.0] * 3])
    out = gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(out["loss"], [[-1.2214028] * 3])
    close(out["clipped"], [[0.0] * 3])
    close(out["dual_clipped"], [[0.0] * 3])


def test_gspo_vs_sequence_ratio_form():
    torch.manual_seed(12)
    lengths = [4, 1, 3, 6]
    mask = span_mask([(1, 5), (0, 1), (3, 6), (0, 6)], 6)
    old = -torch.rand(4, 6) * 2
    logp = (old + 0.3 * torch.randn(4, 6)).requires_grad_()
    adv = torch.randn(4, 1).expand(4, 6)
    out = gspo_policy_loss(logp, old, adv, mask, clip_low=5.0, clip_high=5.0)  # wide: nothing clips
    # loop reference: s_i = exp(mean over the row's tokens of logp - old)
    seq_ratio = []
    for i in range(4):
        toks = [t for t in range(6) if mask[i, t]]
        assert len(toks) == lengths[i]
        seq_ratio.append(torch.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks)))
    seq_ratio = torch.stack(seq_ratio)
    close(out["ratio"], seq_ratio.detach()[:, None].expand(4, 6))
    # per-token form, averaged within each sequence, has the gradient of the sequence-level objective -A_i s_i
    token_form = aggregate(out["loss"], mask, "seq-mean-token-mean", global_tokens=14, global_seqs=4)
    seq_form = (-adv[:, 0] * seq_ratio).mean()
    close(token_form, seq_form)
    (g_token,) = torch.autograd.grad(token_form, logp)
    (g_seq,) = torch.autograd.grad(seq_form, logp)
    close(g_token, g_seq)
    assert g_seq.abs().sum() > 0


def test_gspo_clipping_vs_loop():
    torch.manual_seed(29)  # a draw where some rows clip and some do not
    mask = span_mask([(0, 3), (2, 7), (1, 2), (0, 7), (4, 6)], 7)
    old, adv = -torch.rand(5, 7), torch.randn(5, 1).expand(5, 7)
    logp = old + 0.4 * torch.randn(5, 7)
    out = gspo_policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.15)
    for i in range(5):
        toks = [t for t in range(7) if mask[i, t]]
        s = math.exp(sum(logp[i, t].item() - old[i, t].item() for t in toks) / len(toks))
        a = adv[i, 0].item()
        l1, l2 = -a * s, -a * min(max(s, 0.9), 1.15)
        close(out["loss"][i], [max(l1, l2)] * 7)
        close(out["clipped"][i], [float(l2 > l1)] * 7)
    assert 0 < out["clipped"].sum() < out["clipped"].numel()


# ---------------------------------------------------------------------------------------------------- value loss


def test_value_loss_hand():
    values = torch.tensor([1.5, 1.1, 0.5])
    old = torch.tensor([1.0, 1.0, 1.0])
    returns = torch.tensor([2.0, 0.0, 0.0])
    out = value_loss(values, old, returns, clip=0.2)
    # 1.5 -> clipped 1.2: max(0.25, 0.64) = 0.64 -> 0.32; 1.1 stays (within 0.2): 1.21 -> 0.605;
    # 0.5 -> clipped 0.8: max(0.25, 0.64) -> 0.32
    close(out["loss"], [0.32, 0.605, 0.32])
    close(out["clipped"], [1.0, 0.0, 1.0])


def test_value_loss_vs_loop():
    torch.manual_seed(14)
    values, old, returns = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    out = value_loss(values, old, returns, clip=0.3)
    exp_loss, exp_clipped = [], []
    for v, o, r in zip(values.flatten().tolist(), old.flatten().tolist(), returns.flatten().tolist()):
        vc = o + min(max(v - o, -0.3), 0.3)
        exp_loss.append(0.5 * max((v - r) ** 2, (vc - r) ** 2))
        exp_clipped.append(float((vc - r) ** 2 > (v - r) ** 2))
    close(out["loss"].flatten(), exp_loss)
    close(out["clipped"].flatten(), exp_clipped)


# ---------------------------------------------------------------------------------------------------- rollout IS


def test_rollout_is_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -1.0], [-1.0, -1.0, -1.0, -1.0], [-3.0, -1.0, -1.0, -1.0]])
    token_ratio = torch.tensor([[1.5, 3.0, 0.5, 10.0], [1.5, 1.2, 1.0, 1.0], [0.4, 1.0, 1.0, 1.0]])
    old = (rollout + token_ratio.log()).requires_grad_()

    out = rollout_is_weights(old, rollout, mask, "token_truncate", cap=2.0)
    close(out["weights"][:, :3], [[1.5, 2.0, 0.5], [1.5, 1.2, 1.0], [0.4, 1.0, 1.0]])
    close(out["masked"], [[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])  # the padded 10.0 is not counted
    assert not out["weights"].requires_grad

    out = rollout_is_weights(old, rollout, mask, "seq_mask", cap=2.0)
    # row 0: 1.5 * 3 * 0.5 = 2.25 > 2 -> dropped; row 1: 1.5 * 1.2 = 1.8 kept, weight 1.8; row 2: 0.4 < 1/2 -> dropped
    close(out["weights"], [[0.0] * 4, [1.8] * 4, [0.0] * 4])
    close(out["masked"], [[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert not out["weights"].requires_grad

    out = rollout_is_weights(old, rollout, mask, "seq_mask", cap=2.0, level="geometric")
    # geometric means: 2.25^(1/3) = 1.3104, 1.8^(1/2) = 1.3416, 0.4 (one token) < 1/2 -> dropped
    close(out["weights"], [[2.25 ** (1 / 3)] * 4, [1.8**0.5] * 4, [0.0] * 4])
    close(out["masked"], [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])

    out = rollout_is_weights(old, rollout, mask, "off", cap=2.0)
    close(out["weights"], torch.ones(3, 4))
    close(out["masked"], torch.zeros(3, 4))
    with pytest.raises(ValueError, match="token_truncate"):
        rollout_is_weights(old, rollout, mask, "seq_truncate", cap=2.0)


def test_rollout_is_vs_loop():
    torch.manual_seed(15)
    mask = span_mask([(0, 4), (2, 5), (1, 2), (0, 6), (3, 6), (0, 1)], 6)
    rollout = -torch.rand(6, 6) * 2
    old = rollout + 0.6 * torch.randn(6, 6)
    cap = 1.5
    trunc = rollout_is_weights(old, rollout, mask, "token_truncate", cap)
    seq = rollout_is_weights(old, rollout, mask, "seq_mask", cap)
    geo = rollout_is_weights(old, rollout, mask, "seq_mask", cap, level="geometric")
    for i in range(6):
        log_ratios = [old[i, t].item() - rollout[i, t].item() for t in range(6) if mask[i, t]]
        r_seq, r_geo = math.exp(sum(log_ratios)), math.exp(sum(log_ratios) / len(log_ratios))
        for t in range(6):
            w = math.exp(old[i, t].item() - rollout[i, t].item())
            assert trunc["weights"][i, t].item() == pytest.approx(min(w, cap), rel=1e-5)
            assert trunc["masked"][i, t].item() == float(bool(mask[i, t]) and w > cap)
            for out, r in ((seq, r_seq), (geo, r_geo)):
                keep = 1 / cap <= r <= cap
                assert out["weights"][i, t].item() == pytest.approx(r if keep else 0.0, rel=1e-5)
                assert out["masked"][i, t].item() == float(bool(mask[i, t]) and not keep)
    assert 0 < (seq["weights"][:, 0] > 0).sum() < 6 and trunc["masked"].sum() > 0
    assert ((seq["weights"][:, 0] - 1).abs() > 0.05).sum() >= 2  # weights, not a 0/1 mask


# ---------------------------------------------------------------------------------------------------- entropy


def ref_entropy_loop(logits, true_vocab):
    out = []
    for row in logits.reshape(-1, logits.shape[-1]).tolist():
        row = row[:true_vocab]
        mx = max(row)
        z = sum(math.exp(v - mx) for v in row)
        out.append(-sum(math.exp(v - mx) / z * (v - mx - math.log(z)) for v in row))
    return torch.tensor(out).view(logits.shape[:-1])


def test_entropy_hand():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(2), 0.0, 0.0, 80.0]]])
    # row 0: uniform over 4 -> log 4 = 1.386294; row 1 with id 3 as padding: p = 0.5, 0.25, 0.25 -> 1.5 log 2
    close(vocab_parallel_entropy(logits[:, :1]), [[1.386294]])
    close(vocab_parallel_entropy(logits, true_vocab=3)[0, 1], 1.039721)


def test_entropy_single_shard_vs_categorical_and_loop():
    torch.manual_seed(16)
    true_vocab = 7
    logits = (torch.randn(2, 3, 10) * 3).requires_grad_()
    padded = torch.where(torch.arange(10) < true_vocab, logits, torch.full_like(logits, 1e4))  # huge padding logits
    ent = vocab_parallel_entropy(padded, true_vocab=true_vocab)
    ref = torch.distributions.Categorical(logits=logits[..., :true_vocab]).entropy()
    close(ent, ref)
    close(ent, ref_entropy_loop(logits.detach(), true_vocab))
    close(vocab_parallel_entropy(logits), torch.distributions.Categorical(logits=logits).entropy())
    (grad,) = torch.autograd.grad(ent.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    close(grad, ref_grad)  # ref_grad is 0 on the padding columns
    assert torch.isfinite(grad).all()


def test_entropy_neg_inf_logits_stay_finite():
    logits = torch.tensor([[[0.0, float("-inf"), 0.0]]], requires_grad=True)
    ent = vocab_parallel_entropy(logits)
    close(ent, [[math.log(2)]])
    (grad,) = torch.autograd.grad(ent.sum(), logits)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("vocab, true_vocab", [(10, 7), (12, 6), (8, 8)])  # (12, 6): shard 1 is all padding
def test_entropy_two_shards(vocab, true_vocab):
    torch.manual_seed(17)
    logits = (torch.randn(2, 3, vocab) * 2).requires_grad_()
    half = vocab // 2
    shards = [logits[..., :half].detach().requires_grad_(), logits[..., half:].detach().requires_grad_()]
    starts = [0, half]

    def run(rank, reduce_sum, reduce_max):
        return vocab_parallel_entropy(
            shards[rank],
            vocab_start=starts[rank],
            true_vocab=true_vocab,
            all_reduce_sum=reduce_sum,
            all_reduce_max=reduce_max,
        )

    def recorder(store):
        def reduce(t):
            store.append(t.detach().clone())
            return t

        return reduce

    # pass 1: each rank's local max; pass 2: each rank's (S, A) partials under the global max
    local_max = [[], []]
    for rank in range(2):
        run(rank, None, recorder(local_max[rank]))
    global_max = torch.maximum(local_max[0][0], local_max[1][0])
    partials = [[], []]
    for rank in range(2):
        run(rank, recorder(partials[rank]), lambda t: global_max)
    # pass 3: the all-reduce adds the other rank's partials (identity backward, like megatron's reduce)
    ents = [run(rank, lambda t, r=rank: t + partials[1 - r][0], lambda t: global_max) for rank in range(2)]

    ref = torch.distributions.Categorical(logits=logits[..., :true_vocab]).entropy()
    close(ents[0], ref)
    close(ents[1], ref)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    for rank in range(2):
        (grad,) = torch.autograd.grad(ents[rank].sum(), shards[rank])
        close(grad, ref_grad[..., starts[rank] : starts[rank] + half])


KL_ROWS = {  # 2 prompts x 3 samples of unequal lengths: (score, logp, ref logp)
    0: (1.0, [-1.0, -2.0], [-1.2, -1.5]),
    1: (0.0, [-0.5, -1.5, -1.0], [-0.5, -1.0, -2.0]),
    2: (0.5, [-2.0], [-1.0]),
    3: (0.25, [-0.3, -0.7], [-0.5, -0.2]),
    4: (1.0, [-0.1, -0.2, -0.3, -0.4], [-0.2, -0.2, -0.6, -0.1]),
    5: (0.0, [-1.1], [-0.4]),
}


def _kl_in_reward_advantages(estimator: str, beta: float, gamma: float = 1.0):
    from megarl.config.loader import load_config
    from megarl.rl.estimate import advantages, pad_rows

    algo = load_config(None, ["model.path=x", f"algorithm.adv_estimator={estimator}", "algorithm.kl_in_reward=true",
                              "algorithm.kl_penalty=k1", f"algorithm.gamma={gamma}"]).algorithm  # fmt: skip
    rows = list(KL_ROWS.values())
    adv, returns, metrics = advantages(
        algo,
        torch.tensor([r[0] for r in rows]),
        torch.tensor([0, 0, 0, 1, 1, 1]),
        pad_rows([torch.ones(len(r[1])) for r in rows]),
        behaviour_logp_NR=pad_rows([torch.tensor(r[1]) for r in rows]),
        ref_logp_NR=pad_rows([torch.tensor(r[2]) for r in rows]),
        values_NR=None,
        kl_ctrl=kl_controller("fixed", beta, 0.1, 1000),
        kl_metric_type="k3",
    )
    return [adv[i, : len(r[1])].tolist() for i, r in enumerate(rows)], metrics


def test_grpo_with_kl_in_reward_against_hand_values():
    """GRPO scores each sequence by its reward minus beta x its summed k1 KL, then normalises within the group."""
    beta = 0.1
    outcome = [s - beta * sum(lp - rf for lp, rf in zip(logp, ref)) for s, logp, ref in KL_ROWS.values()]
    expected = []
    for group in (outcome[:3], outcome[3:]):
        mean, std = sum(group) / 3, math.sqrt(sum((x - sum(group) / 3) ** 2 for x in group) / 2)
        expected += [(x - mean) / (std + 1e-6) for x in group]
    adv, metrics = _kl_in_reward_advantages("grpo", beta)
    for row, e, (_, logp, _) in zip(adv, expected, KL_ROWS.values()):
        assert row == pytest.approx([e] * len(logp), abs=1e-5)
    assert metrics["kl/coef"] == beta
    assert outcome[0] == pytest.approx(1.03) and outcome[4] == pytest.approx(0.99)  # the KL moved the scores


def test_reinforce_pp_with_kl_in_reward_against_hand_values():
    """REINFORCE++: token reward -beta x k1 KL, plus the score on the last token; discounted returns-to-go; whitened
    over every token of the batch (unbiased variance)."""
    beta, gamma = 0.1, 0.9
    returns = []
    for score, logp, ref in KL_ROWS.values():
        rewards = [-beta * (lp - rf) for lp, rf in zip(logp, ref)]
        rewards[-1] += score
        row, running = [], 0.0
        for r in reversed(rewards):
            running = r + gamma * running
            row.insert(0, running)
        returns.append(row)
    flat = [g for row in returns for g in row]
    mean = sum(flat) / len(flat)
    var = sum((g - mean) ** 2 for g in flat) / (len(flat) - 1)
    expected = [[(g - mean) / math.sqrt(var + 1e-8) for g in row] for row in returns]
    adv, _ = _kl_in_reward_advantages("reinforce_pp", beta, gamma)
    for row, e in zip(adv, expected):
        assert row == pytest.approx(e, abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_one_pass_vs_log_softmax_with_padding_and_temperature(temperature):
    torch.manual_seed(18)
    true_vocab = 7
    logits = (torch.randn(2, 3, 10) * 3).requires_grad_()
    targets = torch.randint(0, true_vocab, (2, 3))
    logp, ent = vocab_parallel_logprobs(logits, targets, true_vocab=true_vocab, temperature=temperature,
                                        with_entropy=True)  # fmt: skip
    scaled = logits[..., :true_vocab] / temperature  # the padding columns (7-9) are not in the distribution
    ref = torch.log_softmax(scaled, -1).gather(-1, targets[..., None]).squeeze(-1)
    close(logp, ref)
    close(ent, torch.distributions.Categorical(logits=scaled.detach()).entropy())
    assert not ent.requires_grad
    weights = torch.randn(2, 3)
    (grad,) = torch.autograd.grad((logp * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
    close(grad, ref_grad)
    assert (grad[..., true_vocab:] == 0).all()
    low, _ = vocab_parallel_logprobs(logits.detach().bfloat16().requires_grad_(), targets, true_vocab=true_vocab)
    assert low.dtype == torch.float32  # bf16 logits: fp32 log-probs, and a bf16 gradient for the logits


def test_logprobs_and_entropy_are_accurate_at_a_large_vocabulary():
    """Against float64 at Qwen's vocabulary: the softmax kernel's own row sum (added up in a few vector lanes on CPU)
    is not the one the log-probs and the entropy use."""
    torch.manual_seed(23)
    logits, targets = torch.randn(1, 16, 152064) * 3, torch.randint(0, 152064, (1, 16))
    logp, ent = vocab_parallel_logprobs(logits, targets, temperature=0.7, with_entropy=True)
    exact = logits.double() / 0.7
    want = torch.log_softmax(exact, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert (logp.double() - want).abs().max() < 1e-5
    assert (ent.double() - torch.distributions.Categorical(logits=exact).entropy()).abs().max() < 5e-5


@pytest.mark.parametrize(
    "vocab, true_vocab, truncated",
    [(10, 7, False), (12, 6, False), (8, 8, False), (8, 8, True)],  # (12, 6): shard 1 is all padding
)
def test_logprobs_two_shards_equal_one(vocab, true_vocab, truncated):
    """Two vocabulary slices: their partial sums add up to the whole vocabulary's, and given the reduced values each
    slice's log-prob, entropy and gradient equal the whole vocabulary's. ``truncated``: the sampler's cutoff leaves
    some positions none of their scores in shard 1."""
    torch.manual_seed(19)
    logits = torch.randn(2, 3, vocab) * 2
    cutoff = None
    if truncated:  # each position keeps its top 2 scores; at [0, 0] and [1, 2] both are in shard 0
        logits[0, 0, :2] = logits[1, 2, 2:4] = 9.0
        cutoff = logits.topk(2, -1).values[..., -1]
    truncation = None if cutoff is None else Truncation(cutoff, torch.zeros_like(cutoff))
    targets = logits.argmax(-1) if truncated else torch.randint(0, true_vocab, (2, 3))
    whole = logits[..., :true_vocab].clone().requires_grad_()
    scores = whole if cutoff is None else whole.masked_fill(whole < cutoff[..., None], float("-inf"))
    top = whole.detach().amax(-1)
    e = torch.exp(scores.detach() - top[..., None])
    p = e / e.sum(-1, keepdim=True)
    expectation = (p * whole.detach()).sum(-1)  # of the scores under the softmax (the entropy's second term)
    reduced = [e.sum(-1), whole.detach().gather(-1, targets[..., None]).squeeze(-1), expectation]
    half = vocab // 2
    shards = [logits[..., :half].clone().requires_grad_(), logits[..., half:].clone().requires_grad_()]
    partials, results = [[], []], []
    for rank in range(2):
        calls = iter(range(len(reduced)))

        def reduce_sum(t, r=rank, calls=calls):
            partials[r].append(t)
            return reduced[next(calls)]

        results.append(vocab_parallel_logprobs(shards[rank], targets, vocab_start=rank * half, true_vocab=true_vocab,
                                               all_reduce_sum=reduce_sum, all_reduce_max=lambda t: top,
                                               with_entropy=True, truncation_BT=truncation))  # fmt: skip
    for mine, theirs, want in zip(*partials, reduced):  # an all-reduce's inputs add up to its result
        close(mine + theirs, want)
    ref = torch.log_softmax(scores, -1).gather(-1, targets[..., None]).squeeze(-1)
    for logp, ent in results:
        close(logp, ref)
        close(ent, torch.distributions.Categorical(logits=scores.detach()).entropy())
    grads = torch.cat([torch.autograd.grad(results[r][0].sum(), shards[r])[0] for r in range(2)], -1)
    (ref_grad,) = torch.autograd.grad(ref.sum(), whole)
    close(grads[..., :true_vocab], ref_grad)
    assert (grads[..., true_vocab:] == 0).all()


# ---------------------------------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (20, 1.0), (20, 0.8), (5, 0.3), (1, 1.0), (300, 0.95)])
def test_truncation_keeps_the_tokens_vllm_keeps(top_k, top_p):
    """megarl.algos.sampling against vLLM's own apply_top_k_top_p (the installed vllm), logits of several scales."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from megarl.algos.sampling import truncate

    gen = torch.Generator().manual_seed(21)
    for scale in (0.3, 1.0, 4.0):
        z = torch.randn(32, 300, generator=gen) * scale
        k = torch.full((32,), top_k) if top_k else None
        p = torch.full((32,), top_p) if top_p < 1 else None
        theirs = apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True)
        mine = truncate(z, top_k, top_p)
        assert torch.equal(torch.isfinite(mine), torch.isfinite(theirs))
        assert torch.isfinite(mine).sum(-1).min() >= 1 and (~torch.isfinite(mine)).any()


def _tied_bf16_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """bf16 logits (as an engine computes them) around 40, where bf16's step is 0.25: many tokens tie, at the cutoff
    too; cast to fp32 as vLLM's sampler does."""
    gen = torch.Generator().manual_seed(seed)
    return (40 + torch.randn(rows, vocab, generator=gen) * 2).bfloat16().float()


def _exactly_k(z: torch.Tensor, k: int) -> torch.Tensor:
    """vLLM's CUDA kernel's top-k: exactly k tokens (the lowest ids among those tied at the k-th score)."""
    kth = z.topk(k, -1).values[:, -1:]
    tied = z == kth
    keep = (z > kth) | (tied & (tied.cumsum(-1) <= k - (z > kth).sum(-1, keepdim=True)))
    return z.masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("top_k, top_p", [(0, 0.7), (0, 0.95), (20, 1.0), (20, 0.8), (40, 0.6)])
@pytest.mark.parametrize("device_rule", ["cpu", "cuda"])
def test_ties_at_the_cutoff_follow_vllms_rule(top_k, top_p, device_rule, monkeypatch):
    """bf16 logits with ties at the cutoff. vLLM's PyTorch path (the CPU build, run here) and, for the CUDA rule, its
    kernel's semantics (top-k keeps exactly k, then the PyTorch path's top-p): the kept set has vLLM's size, and
    log p of every token vLLM keeps is vLLM's log_softmax over its kept set (megarl kept every tie before: its
    log-probs were lower by up to log(ties / needed))."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from megarl.algos import sampling
    from megarl.algos.sampling import target_truncation, truncate

    monkeypatch.setattr(sampling, "top_k_keeps_ties", lambda device: device_rule == "cpu")
    z = _tied_bf16_logits(64, 256, seed=31)
    k = torch.full((64,), top_k) if top_k else None
    p = torch.full((64,), top_p) if top_p < 1 else None
    if device_rule == "cpu":
        theirs = apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True)
    else:
        exact = _exactly_k(z, top_k) if top_k else z.clone()
        theirs = exact if p is None else apply_top_k_top_p_pytorch(exact, None, p)
    kept = sampling.truncation(z, top_k, top_p)
    n_theirs = torch.isfinite(theirs).sum(-1)
    assert torch.equal((z > kept.cutoff[:, None]).sum(-1) + kept.at_cutoff, n_theirs)
    assert torch.equal(torch.isfinite(truncate(z, top_k, top_p)).sum(-1), n_theirs)
    partial = (z == kept.cutoff[:, None]).sum(-1) > kept.at_cutoff  # rows where some tied tokens are dropped
    if device_rule == "cuda" or top_p < 1:  # where the rule drops some tied tokens: the case this test is about
        assert partial.sum() >= 4, int(partial.sum())
    want = torch.log_softmax(theirs, -1)
    for target_rank in range(3):  # every row's target among vLLM's kept tokens, some of them tied at its cutoff
        order = torch.argsort(theirs, dim=-1, descending=True, stable=True)
        targets = order.gather(-1, (n_theirs - 1 - target_rank).clamp(min=0)[:, None]).squeeze(-1)
        logits = z.clone().requires_grad_()
        logp, _ = vocab_parallel_logprobs(logits, targets, truncation_BT=target_truncation(z, targets, top_k, top_p))
        close(logp, want.gather(-1, targets[:, None]).squeeze(-1))
        (grad,) = torch.autograd.grad(logp.sum(), logits)
        assert torch.isfinite(grad).all() and (grad.sum(-1).abs() < 1e-5).all()  # d log p / dz sums to 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_under_truncation_are_the_truncated_softmax(temperature):
    """With the sampler's cutoff, log p(target), its entropy and gradient are those of log_softmax over the kept
    scores of logits / T: what vLLM returns as processed_logprobs."""
    from megarl.algos.sampling import target_truncation, truncate

    torch.manual_seed(22)
    true_vocab = 40
    logits = (torch.randn(2, 5, 48) * 2).requires_grad_()
    scaled = logits[..., :true_vocab].detach() / temperature
    kept = truncate(scaled, 8, 0.9)
    targets = torch.distributions.Categorical(logits=kept).sample()  # drawn from the truncated distribution
    truncation = target_truncation(scaled, targets, 8, 0.9)
    logp, ent = vocab_parallel_logprobs(logits, targets, true_vocab=true_vocab, temperature=temperature,
                                        with_entropy=True, truncation_BT=truncation)  # fmt: skip
    ref_in = logits[..., :true_vocab] / temperature
    ref_in = ref_in.masked_fill(~torch.isfinite(kept), float("-inf"))
    ref = torch.log_softmax(ref_in, -1).gather(-1, targets[..., None]).squeeze(-1)
    close(logp, ref)
    close(ent, torch.distributions.Categorical(logits=kept).entropy())
    full = torch.log_softmax(scaled, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert (logp.detach() - full).min() > 1e-3  # renormalised over fewer tokens: every log-prob is higher
    (grad,) = torch.autograd.grad(logp.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    close(grad, ref_grad)
    assert (grad[..., :true_vocab][~torch.isfinite(kept)] == 0).all()
