"""KL to the reference policy: per-token estimators, the in-reward penalty and its coefficient controllers."""

from __future__ import annotations

import torch

from megarl.algos.advantages import masked_mean


def _k1(logp, ref):
    return logp - ref


def _k2(logp, ref):
    return 0.5 * (logp - ref) ** 2


def _k3(logp, ref):
    """Schulman's low-variance unbiased estimator exp(r) - r - 1 with r = ref - logp, clamped for stability."""
    r = ref - logp
    return (torch.exp(r) - r - 1).clamp(min=-10, max=10)


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate (differentiable in ``logp``)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp.float(), ref_logp.float())


def kl_penalty_rewards(token_scores_NR, logp_NR, ref_logp_NR, mask_NR, coef: float, kind: str):
    """token_scores - coef x KL per token (masked), and the masked token-mean KL."""
    kl = kl_estimate(logp_NR, ref_logp_NR, kind) * mask_NR
    return token_scores_NR - coef * kl, float(masked_mean(kl, mask_NR))


class FixedKLController:
    """A constant coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, d: dict) -> None:
        self.value = float(d["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (2019): move the coefficient so that the observed KL approaches ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        super().__init__(init_kl_coef)
        self.target, self.horizon = float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


KL_CONTROLLERS = {
    "fixed": lambda kl_coef, target_kl, horizon: FixedKLController(kl_coef),
    "adaptive": lambda kl_coef, target_kl, horizon: AdaptiveKLController(kl_coef, target_kl, horizon),
}


def kl_controller(type: str, kl_coef: float, target_kl: float, horizon: int):
    if type not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller {type!r}; choose one of {sorted(KL_CONTROLLERS)}")
    return KL_CONTROLLERS[type](kl_coef, target_kl, horizon)
