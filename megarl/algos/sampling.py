"""The sampler's truncation, as vLLM applies it (``apply_top_k_top_p``): top-k keeps the tokens whose score is at
least the k-th largest; top-p then keeps, on the distribution top-k left, the most likely tokens until the mass of
the tokens ranked above a token reaches p (so at least one). Every kept set is the scores >= a cutoff, one value per
position: the rollout engines sample from, and return log-probabilities of, softmax over the kept tokens; the
trainer recomputes log-probabilities over the same set."""

from __future__ import annotations

import torch


def truncates(top_k: int, top_p: float) -> bool:
    """Whether these settings truncate anything."""
    return bool(top_k) or top_p < 1.0


@torch.no_grad()
def truncation_cutoff(z_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[N] the smallest score each row keeps under top-k (0: off) then top-p (1: off); -inf when nothing is cut."""
    z = z_NV.float()
    cutoff = torch.full(z.shape[:-1], float("-inf"), device=z.device)
    if top_k and top_k < z.shape[-1]:
        cutoff = z.topk(top_k, dim=-1).values[..., -1]
        z = z.masked_fill(z < cutoff.unsqueeze(-1), float("-inf"))
    if top_p < 1.0:
        ascending = z.sort(dim=-1).values
        dropped = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # vLLM: the lightest tail of mass <= 1 - p goes
        dropped[..., -1] = False
        first_kept = dropped.sum(-1, keepdim=True)  # the tail is a prefix of the ascending order
        cutoff = torch.maximum(cutoff, ascending.gather(-1, first_kept).squeeze(-1))
    return cutoff


def mask_below(z_NV: torch.Tensor, cutoff_N: torch.Tensor) -> torch.Tensor:
    """A copy of the scores with those below their position's cutoff set to -inf (probability 0)."""
    return z_NV.masked_fill(z_NV < cutoff_N.unsqueeze(-1), float("-inf"))


def truncate(z_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Scores outside the top-k tokens / the top-p nucleus set to -inf (at least one token kept)."""
    if not truncates(top_k, top_p):
        return z_NV
    return mask_below(z_NV, truncation_cutoff(z_NV, top_k, top_p))
