"""KL to the reference policy: per-token estimators, the in-reward penalty and the penalty's coefficient controllers."""

from __future__ import annotations

import torch

from megarl.config.schema import K1_LOSS_REFUSED, KL_LOSSES  # the recipe's vocabulary: the schema refuses the rest


def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


LOG_RATIO_CLAMP = 20.0
"""k3's log-ratio is clamped to +-this before ``exp`` (verl): exp(100) overflows float32."""
K3_VALUE_CLAMP = 10.0
"""k3's *value* as an estimate (a metric, the in-reward penalty) is clamped to +-this against outliers (verl). The
KL loss never differentiates a clamped value: a clamp has no gradient where it binds (``kl_loss_terms``)."""


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # Schulman's low-variance estimator exp(r) - r - 1, r = ref - logp; clamped because exp(r) explodes on outliers.
    r = (ref_logp - logp).clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    return (torch.exp(r) - r - 1).clamp(min=-K3_VALUE_CLAMP, max=K3_VALUE_CLAMP)


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise estimate of KL(pi || ref) from sampled-token log-probs (k3's value clamped, so without gradient
    where the clamp binds: a loss uses ``kl_loss_terms``)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp.float(), ref_logp.float())


def _with_gradient(value: torch.Tensor, logp: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """A term whose value is ``value`` and whose gradient is ``coef`` x grad logp (both held constant)."""
    return value.detach() + coef.detach() * (logp - logp.detach())


def kl_loss_terms(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    old_logp: torch.Tensor,
    kind: str,
    behaviour_logp: torch.Tensor | None = None,
    cap: float = float("inf"),
) -> torch.Tensor:
    """Per-token KL-to-reference loss, differentiable in ``logp``, for tokens sampled from ``old_logp``'s policy.

    ``k2``: (log pi/ref)^2 / 2, whose gradient (log pi/ref) grad log pi has expectation grad KL(pi || ref) on
    samples of pi itself. ``k3``: ref/pi - log(ref/pi) - 1, gradient (1 - ref/pi) grad log pi, expectation
    grad KL(ref || pi). ``k3_is``: (pi / sg[pi_old]) k3, gradient (pi/pi_old) (log pi/ref) grad log pi, expectation
    over pi_old's samples grad KL(pi || ref); its value estimates KL(pi || ref) without bias. Each gradient is the
    exact one wherever the policy is: k3's value is reported clamped (``K3_VALUE_CLAMP``) but its gradient is written
    out, never that of a clamp (which is 0 where it binds, leaving k3_is only its ratio's +10 pi/pi_old: a gradient
    of the wrong sign where pi < ref / 13.6); k3's ref/pi is bounded by exp(``LOG_RATIO_CLAMP``) against overflow.

    ``behaviour_logp``: the log-probs of the policy mu that sampled the tokens, where it is not pi_old (the async
    modes' older weights, the engine's numerics): every term is then weighted by min(pi_old / mu, ``cap``), the
    rollout importance weight, so that the expectations above hold over mu's samples."""
    if kind == "k1":
        raise ValueError(K1_LOSS_REFUSED)
    if kind not in KL_LOSSES:
        raise ValueError(f"unknown KL loss {kind!r}; choose one of {list(KL_LOSSES)}")
    logp, ref_logp, old_logp = logp.float(), ref_logp.detach().float(), old_logp.detach().float()
    log_ratio = logp.detach() - ref_logp
    if kind == "k2":
        terms = 0.5 * (logp - ref_logp) ** 2
    elif kind == "k3":
        ref_over_pi = torch.exp((-log_ratio).clamp(max=LOG_RATIO_CLAMP))
        terms = _with_gradient(kl_estimate(logp.detach(), ref_logp, "k3"), logp, 1 - ref_over_pi)
    else:  # k3_is
        ratio = torch.exp((logp.detach() - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        terms = _with_gradient(ratio * kl_estimate(logp.detach(), ref_logp, "k3"), logp, ratio * log_ratio)
    if behaviour_logp is not None:
        terms = terms * torch.exp(old_logp - behaviour_logp.detach().float()).clamp(max=cap)
    return terms


def kl_value_estimator(loss_kind: str) -> str:
    """The plain estimator (k1, k2, k3) whose value a KL loss reports as a metric: k3_is's is k3's."""
    return "k3" if loss_kind == "k3_is" else loss_kind


def kl_penalty_rewards(
    token_scores_NR: torch.Tensor,
    logp_NR: torch.Tensor,
    ref_logp_NR: torch.Tensor,
    mask_NR: torch.Tensor,
    coef: float,
    kind: str,
) -> tuple[torch.Tensor, float]:
    """(token_scores - coef * KL on real tokens, the mean over sequences of each sequence's token-mean KL: what the
    adaptive controller sees, as in verl)."""
    kl = torch.where(mask_NR.bool(), kl_estimate(logp_NR, ref_logp_NR, kind), 0.0)
    per_seq = kl.sum(-1) / mask_NR.sum(-1).clamp(min=1)
    return token_scores_NR.float() - coef * kl, float(per_seq.mean())


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
