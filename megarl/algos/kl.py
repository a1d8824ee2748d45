"""KL to the reference policy: per-token estimators, the in-reward penalty and the penalty's coefficient controllers."""

from __future__ import annotations

import torch

from megarl.algos.advantages import masked_mean


def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # Schulman's low-variance estimator exp(r) - r - 1, r = ref - logp; clamped because exp(r) explodes on outliers.
    r = ref_logp - logp
    return (torch.exp(r) - r - 1).clamp(min=-10, max=10)


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise estimate of KL(pi || ref) from sampled-token log-probs (differentiable in ``logp``)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp.float(), ref_logp.float())


def kl_penalty_rewards(
    token_scores_NR: torch.Tensor,
    logp_NR: torch.Tensor,
    ref_logp_NR: torch.Tensor,
    mask_NR: torch.Tensor,
    coef: float,
    kind: str,
) -> tuple[torch.Tensor, float]:
    """(token_scores - coef * KL on real tokens, masked token-mean KL: what the adaptive controller sees)."""
    kl = torch.where(mask_NR.bool(), kl_estimate(logp_NR, ref_logp_NR, kind), 0.0)
    return token_scores_NR.float() - coef * kl, float(masked_mean(kl, mask_NR))


class FixedKLController:
    """A constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No change."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, d: dict[str, float]) -> None:
        self.value = float(d["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. (2019): scale the coefficient so that the observed KL approaches ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        super().__init__(init_kl_coef)
        self.target_kl, self.horizon = float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """value *= 1 + clip(current / target - 1, -0.2, 0.2) * n_steps / horizon."""
        error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


KL_CONTROLLERS = {
    "fixed": lambda kl_coef, target_kl, horizon: FixedKLController(kl_coef),
    "adaptive": AdaptiveKLController,
}


def kl_controller(type: str, kl_coef: float, target_kl: float, horizon: int) -> FixedKLController:
    """The KL coefficient controller named ``type`` ('fixed' or 'adaptive')."""
    if type not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller {type!r}; choose one of {sorted(KL_CONTROLLERS)}")
    return KL_CONTROLLERS[type](kl_coef, target_kl, horizon)
