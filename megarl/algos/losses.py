"""Per-token RL losses and their aggregation (pure tensor functions; rows are sequences, ``mask`` marks response
tokens). Aggregation returns one batch's *contribution* to a global aggregate, so that the sum over micro-batches
and ranks equals the aggregate over the whole mini-batch."""

from __future__ import annotations

import torch


def _token_mean(loss, mask, tokens, seqs, norm_len):
    return (loss * mask).sum() / tokens


def _seq_mean_token_sum(loss, mask, tokens, seqs, norm_len):
    return (loss * mask).sum() / seqs


def _seq_mean_token_mean(loss, mask, tokens, seqs, norm_len):
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / seqs


def _seq_mean_token_sum_norm(loss, mask, tokens, seqs, norm_len):
    if not norm_len:
        raise ValueError("seq-mean-token-sum-norm needs norm_len (the constant length, e.g. max_new_tokens)")
    return (loss * mask).sum() / (seqs * norm_len)


AGGREGATIONS = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(loss_BT, mask_BT, mode: str, *, global_tokens: int, global_seqs: int, norm_len: int | None = None):
    """This batch's contribution to ``mode`` over a mini-batch of ``global_tokens`` tokens in ``global_seqs`` rows."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {list(AGGREGATIONS)}")
    return AGGREGATIONS[mode](loss_BT, mask_BT.to(loss_BT.dtype), max(global_tokens, 1), max(global_seqs, 1), norm_len)


def _clipped_objective(ratio, adv, clip_low, clip_high, clip_c=None):
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped_loss = torch.maximum(loss1, loss2)
    out = {"clipped": (loss2 > loss1).float()}
    if clip_c is None:
        out["loss"], out["dual_clipped"] = clipped_loss, torch.zeros_like(clipped_loss)
        return out
    bound = -adv * clip_c
    dual = (adv < 0) & (bound < clipped_loss)
    out["loss"] = torch.where(adv < 0, torch.minimum(clipped_loss, bound), clipped_loss)
    out["dual_clipped"] = dual.float()
    return out


def ppo_policy_loss(logp_BT, old_logp_BT, adv_BT, *, clip_low: float, clip_high: float, clip_c: float) -> dict:
    """PPO's clipped surrogate with separate low/high clip (DAPO clip-higher) and dual clip for A < 0.

    Per-token tensors: ``loss``, ``clipped``, ``dual_clipped``, ``ratio``, ``approx_kl`` (old - new)."""
    log_ratio = (logp_BT - old_logp_BT).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    out = _clipped_objective(ratio, adv_BT, clip_low, clip_high, clip_c)
    out["ratio"], out["approx_kl"] = ratio.detach(), -log_ratio.detach()
    return out


def gspo_policy_loss(logp_BT, old_logp_BT, adv_BT, mask_BT, *, clip_low: float, clip_high: float) -> dict:
    """GSPO: the sequence-level ratio exp(mean over the row of log(pi/pi_old)), applied per token as
    sg[s_i] * pi_t / sg[pi_t] (value s_i, gradient through each token), clipped as in PPO."""
    mask = mask_BT.to(logp_BT.dtype)
    log_ratio = (logp_BT - old_logp_BT) * mask
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    token_log_ratio = seq_log_ratio.detach() + logp_BT - logp_BT.detach()
    ratio = torch.exp(token_log_ratio.clamp(max=10))
    out = _clipped_objective(ratio, adv_BT, clip_low, clip_high)
    out["ratio"], out["approx_kl"] = ratio.detach(), -(logp_BT - old_logp_BT).detach()
    return out


def value_loss(values_BT, old_values_BT, returns_BT, clip: float) -> dict:
    """0.5 x max((v - R)^2, (v_clipped - R)^2) with v_clipped within ``clip`` of the rollout-time value."""
    clipped_values = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    loss1 = (values_BT - returns_BT) ** 2
    loss2 = (clipped_values - returns_BT) ** 2
    return {"loss": 0.5 * torch.maximum(loss1, loss2), "clipped": (loss2 > loss1).float()}


def _is_off(log_ratio, mask, cap):
    return torch.ones_like(log_ratio), torch.zeros_like(log_ratio)


def _is_token_truncate(log_ratio, mask, cap):
    weights = torch.exp(log_ratio.clamp(max=20))
    return weights.clamp(max=cap), (weights > cap).float() * mask


def _is_seq_mask(log_ratio, mask, cap):
    import math

    seq = (log_ratio * mask).sum(-1, keepdim=True)
    keep = ((seq >= -math.log(cap)) & (seq <= math.log(cap))).float().expand_as(log_ratio)
    return keep, (1 - keep) * mask


ROLLOUT_IS = {"off": _is_off, "token_truncate": _is_token_truncate, "seq_mask": _is_seq_mask}


@torch.no_grad()
def rollout_is_weights(old_logp_BT, rollout_logp_BT, mask_BT, mode: str, cap: float) -> dict:
    """Importance weights pi_old / pi_rollout correcting the engine-vs-trainer mismatch: ``token_truncate`` caps each
    token's weight at ``cap``; ``seq_mask`` drops whole sequences whose ratio leaves [1/cap, cap]. ``masked`` marks
    the tokens that were truncated or dropped."""
    if mode not in ROLLOUT_IS:
        raise ValueError(f"unknown rollout_is mode {mode!r}; choose one of {list(ROLLOUT_IS)}")
    mask = mask_BT.float()
    weights, masked = ROLLOUT_IS[mode]((old_logp_BT - rollout_logp_BT).float(), mask, cap)
    return {"weights": weights, "masked": masked}


def vocab_parallel_entropy(
    logits_BTV, *, vocab_start: int = 0, true_vocab: int | None = None, all_reduce_sum=None, all_reduce_max=None
) -> torch.Tensor:
    """Entropy of softmax over the full vocabulary from this rank's slice [vocab_start, vocab_start + V) of the
    logits, without gathering them: H = log S + m - A / S, S = sum exp(x - m), A = sum exp(x - m) x. Entries with
    global id >= ``true_vocab`` are padding (probability 0). ``all_reduce_sum`` must be differentiable (backward:
    identity); ``all_reduce_max`` only stabilises and carries no gradient. None: a single shard."""
    reduce_sum = all_reduce_sum or (lambda x: x)
    reduce_max = all_reduce_max or (lambda x: x)
    x = logits_BTV.float()
    if true_vocab is not None:
        ids = torch.arange(vocab_start, vocab_start + x.shape[-1], device=x.device)
        valid = ids < true_vocab
    else:
        valid = torch.ones(x.shape[-1], dtype=torch.bool, device=x.device)
    x_safe = torch.where(valid, x, torch.zeros_like(x))  # padding values never reach exp or a product
    local_max = torch.where(valid, x, torch.full_like(x, float("-inf"))).max(-1, keepdim=True).values
    m = reduce_max(local_max.detach())
    e = torch.where(valid, torch.exp(x_safe - m), torch.zeros_like(x))
    s = reduce_sum(e.sum(-1, keepdim=True))
    a = reduce_sum((e * x_safe).sum(-1, keepdim=True))
    return (torch.log(s) + m - a / s).squeeze(-1)
