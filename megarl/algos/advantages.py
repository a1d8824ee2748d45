"""Advantage estimators on response-aligned tensors [N, R]: rows are sequences, right-padded, ``mask_NR`` is 1 on real
tokens (contiguous from position 0 within each row).

Batch statistics (whitening, group baselines) are over the whole tensor given: the trainer calls these on the step's
full batch, identical on every rank. Results are fp32.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1 (over ``dim``, or the whole tensor); 0 when there are none."""
    keep = mask.bool()
    total = torch.where(keep, x.float(), 0.0)
    if dim is None:
        return total.sum() / keep.sum().clamp(min=1)
    return total.sum(dim) / keep.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of the whole tensor (Bessel-corrected when ``unbiased`` and count > 1)."""
    keep = mask.bool()
    count = keep.sum()
    sq_dev = torch.where(keep, x.float() - masked_mean(x, mask), 0.0) ** 2
    denom = count - 1 if unbiased else count
    return sq_dev.sum() / denom.clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) * rsqrt(var + eps) over the masked entries (mean added back when ``shift_mean=False``); 0 outside
    the mask."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x.float() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, 0.0)


def broadcast_to_tokens(adv_N: torch.Tensor, mask_NR: torch.Tensor) -> torch.Tensor:
    """A per-sequence value on every real token of its row, 0 elsewhere."""
    return torch.where(mask_NR.bool(), adv_N.float().unsqueeze(-1), 0.0)


def token_level_scores(scores_N: torch.Tensor, mask_NR: torch.Tensor) -> torch.Tensor:
    """The sequence score on each row's last real token, 0 elsewhere (and 0 for rows without tokens)."""
    keep = mask_NR.bool()
    positions = torch.arange(1, keep.shape[1] + 1, device=keep.device)
    last_R = (positions * keep).argmax(-1)  # the largest masked position; 0 for empty rows, zeroed below
    out = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
    out[torch.arange(keep.shape[0], device=keep.device), last_R] = scores_N.float()
    return torch.where(keep, out, 0.0)


def gae(
    token_rewards_NR: torch.Tensor,
    values_NR: torch.Tensor,
    mask_NR: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, terminal at each row's last real token (V there-after = 0).

    Returns (advantages, returns = unwhitened advantages + values), both 0 outside the mask; advantages are whitened
    over the batch when ``whiten``."""
    keep = mask_NR.bool()
    values = torch.where(keep, values_NR.float(), 0.0)
    rewards = torch.where(keep, token_rewards_NR.float(), 0.0)
    n_rows, width = keep.shape
    adv = torch.zeros_like(rewards)
    next_adv = torch.zeros(n_rows, device=rewards.device)
    next_value = torch.zeros(n_rows, device=rewards.device)
    for t in reversed(range(width)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = torch.where(keep[:, t], delta + gamma * lam * next_adv, 0.0)
        adv[:, t] = next_adv
        next_value = values[:, t]
    returns = torch.where(keep, adv + values, 0.0)
    return (masked_whiten(adv, keep) if whiten else adv), returns


def _group_index(group_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense group index per sequence, samples per group)."""
    _, index_N, counts_G = torch.unique(group_N, return_inverse=True, return_counts=True)
    return index_N, counts_G


def _group_sum(x_N: torch.Tensor, index_N: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=x_N.dtype, device=x_N.device).index_add_(0, index_N, x_N)


def grpo(scores_N: torch.Tensor, group_N: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(s - group mean) / (group std + eps) with the unbiased std; ``norm_by_std=False``: s - group mean (Dr. GRPO).
    A group of one has mean 0 and std 1, so its advantage is the raw score (verl's convention)."""
    scores = scores_N.double()
    index_N, counts_G = _group_index(group_N)
    single_G = counts_G == 1
    mean_G = torch.where(single_G, 0.0, _group_sum(scores, index_N, len(counts_G)) / counts_G)
    centred = scores - mean_G[index_N]
    if not norm_by_std:
        return centred.float()
    var_G = _group_sum(centred**2, index_N, len(counts_G)) / (counts_G - 1).clamp(min=1)
    std_G = torch.where(single_G, 1.0, var_G.sqrt())
    return (centred / (std_G[index_N] + eps)).float()


def rloo(scores_N: torch.Tensor, group_N: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: s_i - mean of the other samples of its group; a group of one keeps its score."""
    scores = scores_N.double()
    index_N, counts_G = _group_index(group_N)
    others_sum = _group_sum(scores, index_N, len(counts_G))[index_N] - scores
    others = (counts_G - 1)[index_N]
    baseline = torch.where(others > 0, others_sum / others.clamp(min=1), 0.0)
    return (scores - baseline).float()


def reinforce_pp(
    token_rewards_NR: torch.Tensor, mask_NR: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go within each row; advantages are the returns whitened over the batch.
    Returns (advantages, returns), both 0 outside the mask. The KL penalty is already in ``token_rewards``."""
    keep = mask_NR.bool()
    rewards = torch.where(keep, token_rewards_NR.float(), 0.0)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(keep.shape[0], device=rewards.device)
    for t in reversed(range(keep.shape[1])):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, 0.0)
        returns[:, t] = running
    return masked_whiten(returns, keep), returns


def reinforce_pp_baseline(scores_N: torch.Tensor, group_N: torch.Tensor, mask_NR: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: score minus its group mean on every response token, then whitened over the batch."""
    scores = scores_N.double()
    index_N, counts_G = _group_index(group_N)
    centred_N = scores - (_group_sum(scores, index_N, len(counts_G)) / counts_G)[index_N]
    return masked_whiten(broadcast_to_tokens(centred_N.float(), mask_NR), mask_NR)
