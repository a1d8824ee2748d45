"""Per-token RL losses and their aggregation. Rows of [B, T] tensors are sequences; ``mask_BT`` marks the response
tokens (anywhere in the row). Losses are unmasked per-token tensors; ``aggregate`` applies the mask."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from megarl.algos.sampling import Truncation
from megarl.config.schema import ROLLOUT_IS_LEVELS

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| beyond this is numerical noise; keeps exp() finite


def _token_mean(loss_BT, keep_BT, tokens, seqs, norm_len):
    return torch.where(keep_BT, loss_BT, 0.0).sum() / tokens


def _seq_mean_token_sum(loss_BT, keep_BT, tokens, seqs, norm_len):
    return torch.where(keep_BT, loss_BT, 0.0).sum() / seqs


def _seq_mean_token_mean(loss_BT, keep_BT, tokens, seqs, norm_len):
    row_mean_B = torch.where(keep_BT, loss_BT, 0.0).sum(-1) / keep_BT.sum(-1).clamp(min=1)
    return row_mean_B.sum() / seqs


def _seq_mean_token_sum_norm(loss_BT, keep_BT, tokens, seqs, norm_len):
    if norm_len is None or norm_len <= 0:
        raise ValueError("seq-mean-token-sum-norm needs norm_len > 0 (a constant length, e.g. max_new_tokens)")
    return torch.where(keep_BT, loss_BT, 0.0).sum() / (seqs * norm_len)


AGGREGATIONS = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    global_tokens: int,
    global_seqs: int,
    norm_len: int | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to the ``mode`` aggregate over a mini-batch of ``global_tokens`` masked tokens
    in ``global_seqs`` rows: summing the contributions of all micro-batches on all ranks gives the global value."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {list(AGGREGATIONS)}")
    return AGGREGATIONS[mode](loss_BT.float(), mask_BT.bool(), max(global_tokens, 1), max(global_seqs, 1), norm_len)


def _clipped_surrogate(ratio_BT, adv_BT, clip_low, clip_high):
    loss1 = -adv_BT * ratio_BT
    loss2 = -adv_BT * ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(loss1, loss2), (loss2 > loss1).float()


def ppo_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
) -> dict[str, torch.Tensor]:
    """PPO's clipped surrogate with ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO's clip-higher) and, for
    A < 0, the dual clip bound -A * clip_c (None: no dual clip).

    Per-token tensors: ``loss``, ``clipped``, ``dual_clipped``, ``ratio``, ``approx_kl`` (old - new)."""
    if clip_c is not None and clip_c <= 1:
        raise ValueError(f"clip_c must be > 1, got {clip_c}")
    logp, old, adv = logp_BT.float(), old_logp_BT.float(), adv_BT.float()
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss, clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    dual_clipped = torch.zeros_like(loss)
    if clip_c is not None:
        bound = -adv * clip_c
        negative = adv < 0
        dual_clipped = (negative & (bound < loss)).float()
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return {
        "loss": loss,
        "clipped": clipped,
        "dual_clipped": dual_clipped,
        "ratio": ratio.detach(),
        "approx_kl": (old - logp).detach(),
    }


def gspo_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> dict[str, torch.Tensor]:
    """GSPO: the sequence ratio s_i = exp(masked row mean of log(pi/pi_old)) applied per token as
    s_it = sg[s_i] * pi_t / sg[pi_t] (value s_i; gradient through each token), then PPO's clipped surrogate on s_it.
    Same keys as ``ppo_policy_loss`` (``dual_clipped`` all zeros)."""
    logp, old, adv = logp_BT.float(), old_logp_BT.float(), adv_BT.float()
    keep = mask_BT.bool()
    log_ratio = torch.where(keep, logp - old, 0.0)
    seq_log_ratio_B1 = log_ratio.sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio_B1 = seq_log_ratio_B1.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(seq_log_ratio_B1.detach() + logp - logp.detach())
    loss, clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    return {
        "loss": loss,
        "clipped": clipped,
        "dual_clipped": torch.zeros_like(loss),
        "ratio": ratio.detach(),
        "approx_kl": (old - logp).detach(),
    }


def value_loss(
    values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor, clip: float
) -> dict[str, torch.Tensor]:
    """Per token: ``loss`` = 0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped = old + clamp(v - old, +-clip);
    ``clipped`` = 1 where the clipped term is the larger."""
    values, old, returns = values_BT.float(), old_values_BT.float(), returns_BT.float()
    clipped_values = old + (values - old).clamp(-clip, clip)
    loss1 = (values - returns) ** 2
    loss2 = (clipped_values - returns) ** 2
    return {"loss": 0.5 * torch.maximum(loss1, loss2), "clipped": (loss2 > loss1).float()}


def _is_off(log_ratio_BT, keep_BT, cap, level):
    return torch.ones_like(log_ratio_BT), torch.zeros_like(log_ratio_BT)


def _is_token_truncate(log_ratio_BT, keep_BT, cap, level):
    weights = torch.exp(log_ratio_BT.clamp(max=LOG_RATIO_CLAMP))
    return weights.clamp(max=cap), (keep_BT & (weights > cap)).float()


def _is_seq_mask(log_ratio_BT, keep_BT, cap, level):
    seq_log_ratio_B1 = torch.where(keep_BT, log_ratio_BT, 0.0).sum(-1, keepdim=True)
    if level == "geometric":
        seq_log_ratio_B1 = seq_log_ratio_B1 / keep_BT.sum(-1, keepdim=True).clamp(min=1)
    kept_B1 = seq_log_ratio_B1.abs() <= math.log(cap)
    weights_B1 = torch.where(kept_B1, torch.exp(seq_log_ratio_B1.clamp(max=math.log(cap))), 0.0)
    return weights_B1.expand_as(log_ratio_BT).contiguous(), (keep_BT & ~kept_B1).float()


ROLLOUT_IS = {"off": _is_off, "token_truncate": _is_token_truncate, "seq_mask": _is_seq_mask}


@torch.no_grad()
def rollout_is_weights(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    cap: float,
    level: str = "sequence",
) -> dict[str, torch.Tensor]:
    """Importance weights pi_old / pi_rollout correcting for the policy that generated the tokens (no gradient).

    ``token_truncate``: per-token weight min(ratio_t, cap). ``seq_mask`` (masked importance sampling): one weight per
    row, the sequence statistic r = prod_t ratio_t (``level`` sequence: the sequence's importance weight) or its
    geometric mean exp(mean_t log ratio_t) (``geometric``: no length bias); weight r where r is in [1/cap, cap],
    else 0. ``masked`` is 1 on the real tokens that were truncated or dropped."""
    if mode not in ROLLOUT_IS:
        raise ValueError(f"unknown rollout_is mode {mode!r}; choose one of {list(ROLLOUT_IS)}")
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout_is level {level!r}; choose one of {list(ROLLOUT_IS_LEVELS)}")
    if mode != "off" and cap < 1:
        raise ValueError(f"rollout_is cap must be >= 1, got {cap}")
    log_ratio = old_logp_BT.detach().float() - rollout_logp_BT.detach().float()
    weights, masked = ROLLOUT_IS[mode](log_ratio, mask_BT.bool(), cap, level)
    return {"weights": weights, "masked": masked}


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def vocab_parallel_entropy(
    logits_BTV: torch.Tensor,
    *,
    vocab_start: int = 0,
    true_vocab: int | None = None,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Entropy [B, T] of softmax over the full vocabulary, from this rank's slice [vocab_start, vocab_start + V) of
    the logits, without gathering them: H = log S + m - A / S with S = sum exp(x - m), A = sum exp(x - m) * x.

    Global ids >= ``true_vocab`` are padding (probability 0). ``all_reduce_max`` (called once, on a detached
    [B, T, 1] tensor) only stabilises; ``all_reduce_sum`` (called once, on [B, T, 2] = (S, A) partials) must be
    differentiable with identity backward. None: a single shard."""
    reduce_sum = all_reduce_sum or _identity
    reduce_max = all_reduce_max or _identity
    x = logits_BTV.float()
    keep_V = torch.ones(x.shape[-1], dtype=torch.bool, device=x.device)
    if true_vocab is not None:
        keep_V = torch.arange(vocab_start, vocab_start + x.shape[-1], device=x.device) < true_vocab
    keep = keep_V & (x > -math.inf)  # exp(-inf) = 0 would meet x = -inf in A: 0 * -inf = nan
    local_max = torch.where(keep, x, -math.inf).amax(-1, keepdim=True)
    m = reduce_max(local_max.detach()).detach()
    e = torch.exp(torch.where(keep, x - m, -math.inf))
    x_safe = torch.where(keep, x, 0.0)
    partial_BT2 = torch.cat([e.sum(-1, keepdim=True), (e * x_safe).sum(-1, keepdim=True)], dim=-1)
    s, a = reduce_sum(partial_BT2).unbind(-1)
    return torch.log(s) + m.squeeze(-1) - a / s


class _VocabParallelLogProbs(torch.autograd.Function):
    """log p(target) under softmax(logits / T) from this rank's vocabulary slice: the slice's softmax (torch's fused
    kernel, one [B, T, V] buffer written), its max and its sum, the softmax rescaled in place to the whole
    vocabulary's (and to an accurately summed one); the entropy of the same softmax when asked (not differentiated).
    Saves the softmax only."""

    @staticmethod
    def forward(
        ctx, logits, targets, vocab_start, true_vocab, temperature, reduce_sum, reduce_max, with_entropy, truncation
    ):
        vocab = logits.shape[-1]
        kept = max(0, min(vocab, true_vocab - vocab_start))  # padding ids (>= true_vocab) are a suffix of the slice
        z = logits[..., :kept].float()  # a copy below fp32, a view in fp32: never written
        z = z / temperature if temperature != 1 else z
        mine = (targets >= vocab_start) & (targets < vocab_start + kept)
        index = (targets - vocab_start).clamp(0, max(kept - 1, 0)).unsqueeze(-1)
        if truncation is not None and kept:  # the sampler's truncation: the scores it drops have probability 0
            z = truncation.apply(z, index.squeeze(-1), mine)
        if kept:  # this slice's softmax from torch's fused kernel: exp(z - local_max) / the kernel's sum
            local_max = z.amax(-1)
            p = torch.softmax(z, -1)
            if truncation is not None:  # a row with none of its scores in this slice: softmax's 0 / 0
                p.nan_to_num_(0.0)
            fused_sum = p.amax(-1).reciprocal()  # p is exp(0) / the kernel's sum at the max
            # the kernel sums a row in a few vector lanes (on CPU ~100 eps off at 150k tokens): the sum, accurately
            local_sum = p.sum(-1) * fused_sum
        else:  # a slice of padding only
            local_max, p = z.new_full(z.shape[:-1], -math.inf), z.new_empty(z.shape)
            fused_sum = local_sum = torch.zeros_like(local_max)
        m = reduce_max(local_max)
        here = local_max != -math.inf  # the row has scores here (a NaN row stays NaN); without, local_sum is 0 x inf
        to_m = torch.exp(local_max - m)
        s = reduce_sum(torch.where(here, local_sum * to_m, 0.0))  # sum of exp(z - m) over the whole vocabulary
        p.mul_(torch.where(here, fused_sum * to_m / s, 0.0).unsqueeze(-1))  # the whole vocabulary's softmax
        target_z = z.gather(-1, index).squeeze(-1) if kept else torch.zeros_like(m)
        log_s = torch.log(s)
        logp = reduce_sum(torch.where(mine, target_z, 0.0)) - m - log_s
        z_finite = z if truncation is None else z.clamp(min=torch.finfo(z.dtype).min)  # 0 x -inf would be nan
        entropy = log_s + m - reduce_sum(torch.linalg.vecdot(p, z_finite)) if with_entropy else logp.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(p, index, mine)
        ctx.shape = (vocab, kept, temperature, logits.dtype)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        p, index, mine = ctx.saved_tensors
        vocab, kept, temperature, dtype = ctx.shape
        if not kept:  # a slice of padding only
            return p.new_zeros(*p.shape[:-1], vocab, dtype=dtype), *[None] * 8
        grad = p.mul_(-grad_logp.unsqueeze(-1))  # d logp / dz = onehot(target) - p, in place of the saved softmax
        grad.scatter_add_(-1, index, torch.where(mine, grad_logp, 0.0).unsqueeze(-1))
        if temperature != 1:
            grad.div_(temperature)
        if kept < vocab:
            grad = torch.nn.functional.pad(grad, (0, vocab - kept))  # padding rows: probability 0, gradient 0
        return grad.to(dtype), *[None] * 8


def vocab_parallel_logprobs(
    logits_BTV: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    vocab_start: int = 0,
    true_vocab: int | None = None,
    temperature: float = 1.0,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
    with_entropy: bool = False,
    truncation_BT: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [B, T] under softmax(logits / T) over the full vocabulary, from this rank's slice
    [vocab_start, vocab_start + V) of the logits without gathering them, differentiable; with ``with_entropy`` also
    the softmax's entropy [B, T] from the same pass (no gradient: for a metric; ``vocab_parallel_entropy`` gives a
    differentiable one). Global ids >= ``true_vocab`` are padding (probability 0). ``all_reduce_max`` and
    ``all_reduce_sum`` reduce [B, T] tensors over the ranks holding the other slices (None: a single shard); they
    are not differentiated. Logits are finite. One fp32 [B, T, V] tensor is kept for backward: the softmax.
    ``truncation_BT``: the sampler's truncation (``megarl.algos.sampling.target_truncation``): the softmax is over the
    scores (logits / T) it keeps, the targets among them."""
    logp, entropy = _VocabParallelLogProbs.apply(
        logits_BTV,
        targets_BT,
        vocab_start,
        logits_BTV.shape[-1] + vocab_start if true_vocab is None else true_vocab,
        temperature,
        all_reduce_sum or _identity,
        all_reduce_max or _identity,
        with_entropy,
        truncation_BT,
    )
    return logp, (entropy if with_entropy else None)
