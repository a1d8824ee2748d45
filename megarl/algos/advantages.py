"""Advantage estimators on response-aligned tensors [N, R] (right-padded; ``mask`` is 1 on real tokens).

All batch statistics (whitening, group baselines) are over the whole tensor given: the trainer calls these on the
step's full batch, identical on every rank.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    count = mask.sum()
    var = (((x - mean) * mask) ** 2).sum() / count.clamp(min=1)
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries (mean added back when ``shift_mean=False``); 0 outside the mask."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def broadcast_to_tokens(adv_N: torch.Tensor, mask_NR: torch.Tensor) -> torch.Tensor:
    return adv_N.unsqueeze(-1) * mask_NR


def token_level_scores(scores_N: torch.Tensor, mask_NR: torch.Tensor) -> torch.Tensor:
    """The sequence score on each row's last real token, 0 elsewhere."""
    out = torch.zeros_like(mask_NR, dtype=torch.float32)
    last = (mask_NR.sum(-1).long() - 1).clamp(min=0)
    out[torch.arange(len(scores_N)), last] = scores_N.float()
    return out * mask_NR


def gae(token_rewards_NR, values_NR, mask_NR, gamma: float, lam: float, whiten: bool = True):
    """Generalised advantage estimation; V beyond each row's last real token is 0 (terminal there).

    Returns (advantages, returns = advantages + values), both 0 outside the mask; advantages whitened over the batch
    when ``whiten``."""
    mask = mask_NR.float()
    values = values_NR.float() * mask
    rewards = token_rewards_NR.float() * mask
    width = mask.shape[1]
    adv = torch.zeros_like(rewards)
    last = torch.zeros(mask.shape[0])
    for t in reversed(range(width)):
        next_value = values[:, t + 1] if t + 1 < width else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        adv[:, t] = last
    returns = (adv + values) * mask
    return (masked_whiten(adv, mask) if whiten else adv), returns


def _groups(group_N: torch.Tensor) -> list[torch.Tensor]:
    return [torch.nonzero(group_N == g).flatten() for g in torch.unique(group_N)]


def grpo(scores_N: torch.Tensor, group_N: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(s - group mean) / (group std + eps); ``norm_by_std=False``: s - group mean (Dr. GRPO). A group of one has
    mean 0 and std 1, so its advantage is the raw score."""
    scores = scores_N.float()
    adv = torch.empty_like(scores)
    for idx in _groups(group_N):
        s = scores[idx]
        mean, std = (s.mean(), s.std()) if len(idx) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        adv[idx] = (s - mean) / (std + eps) if norm_by_std else s - mean
    return adv


def rloo(scores_N: torch.Tensor, group_N: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: s_i - mean of the other samples of the group; a group of one keeps its score."""
    scores = scores_N.float()
    adv = scores.clone()
    for idx in _groups(group_N):
        n = len(idx)
        if n > 1:
            s = scores[idx]
            adv[idx] = s - (s.sum() - s) / (n - 1)
    return adv


def reinforce_pp(token_rewards_NR, mask_NR, gamma: float):
    """REINFORCE++: discounted return-to-go within each row, whitened over the batch (advantages, returns)."""
    mask = mask_NR.float()
    rewards = token_rewards_NR.float() * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(mask.shape[0])
    for t in reversed(range(mask.shape[1])):
        running = rewards[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    returns = returns * mask
    return masked_whiten(returns, mask), returns


def reinforce_pp_baseline(scores_N: torch.Tensor, group_N: torch.Tensor, mask_NR: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: score minus its group mean on every response token, then whitened over the batch."""
    scores = scores_N.float()
    centred = scores.clone()
    for idx in _groups(group_N):
        centred[idx] = scores[idx] - scores[idx].mean()
    return masked_whiten(broadcast_to_tokens(centred, mask_NR.float()), mask_NR.float())
