"""The sampler's truncation, as vLLM applies it (``apply_top_k_top_p``): top-k keeps the k highest scores; top-p then
keeps, on the distribution top-k left, the most likely tokens until the mass of the tokens ranked above a token
reaches p (so at least one). The rollout engines sample from, and return log-probabilities of, softmax over the kept
tokens; the trainer recomputes log-probabilities over the same set.

Ties at the cutoff (frequent with bf16 logits) follow vLLM's rule. Top-p keeps only as many of the tokens tied at
its cutoff as it needs (its PyTorch path drops a prefix of the ascending sort by position; its CUDA kernel keeps an
index-ordered budget of them). Top-k on CUDA (the Triton kernel) keeps exactly k; vLLM's PyTorch path, which its
CPU build runs, keeps every token tied with the k-th score (``top_k_keeps_ties``). A kept set is therefore its
cutoff (the smallest kept score) and how many of the tokens scoring exactly the cutoff it keeps: which of those
tied tokens is kept changes no probability, only the sampled id (the HF engine keeps the lowest ids)."""

from __future__ import annotations

from typing import NamedTuple

import torch


def truncates(top_k: int, top_p: float) -> bool:
    """Whether these settings truncate anything."""
    return bool(top_k) or top_p < 1.0


def top_k_keeps_ties(device: torch.device) -> bool:
    """vLLM's top-k rule for ties at the k-th score on this device: its PyTorch path (the CPU build) keeps them all,
    its CUDA kernel keeps exactly k."""
    return device.type != "cuda"


class Kept(NamedTuple):
    """The sampler's kept set at every position: the scores above ``cutoff``, and ``at_cutoff`` of those equal to it."""

    cutoff: torch.Tensor
    """[N] the smallest score kept (-inf: nothing is cut)."""
    at_cutoff: torch.Tensor
    """[N] (int64) how many of the tokens scoring exactly ``cutoff`` are kept (>= 1 where something is cut)."""


def _keep_first(tied_NV: torch.Tensor, count_N: torch.Tensor) -> torch.Tensor:
    """The first ``count`` (lowest ids) of each row's tied tokens."""
    return tied_NV & (tied_NV.cumsum(-1) <= count_N.unsqueeze(-1))


@torch.no_grad()
def truncation(z_NV: torch.Tensor, top_k: int, top_p: float) -> Kept:
    """The kept set of each row of scores under top-k (0: off) then top-p (1: off), with vLLM's rule for ties."""
    z = z_NV.float()
    n = z.shape[:-1]
    cutoff = torch.full(n, float("-inf"), device=z.device)
    at_cutoff = torch.zeros(n, dtype=torch.long, device=z.device)
    if top_k and top_k < z.shape[-1]:
        cutoff = z.topk(top_k, dim=-1).values[..., -1]
        tied = z == cutoff.unsqueeze(-1)
        at_cutoff = tied.sum(-1)
        if not top_k_keeps_ties(z.device):  # exactly k: the lowest ids among the tied
            at_cutoff = top_k - (z > cutoff.unsqueeze(-1)).sum(-1)
        z = z.masked_fill((z < cutoff.unsqueeze(-1)) | (tied & ~_keep_first(tied, at_cutoff)), float("-inf"))
    if top_p < 1.0:
        ascending = z.sort(dim=-1).values
        dropped = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # vLLM: the lightest tail of mass <= 1 - p goes
        dropped[..., -1] = False
        first_kept = dropped.sum(-1)  # the tail is a prefix of the ascending order
        cutoff = ascending.gather(-1, first_kept.unsqueeze(-1)).squeeze(-1)  # >= top-k's: its dropped are -inf
        at_cutoff = (ascending <= cutoff.unsqueeze(-1)).sum(-1) - first_kept  # the kept ties: [first_kept, that)
    return Kept(cutoff, at_cutoff)


def truncate(z_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Scores outside the kept set (``truncation``; of the tokens tied at the cutoff, the lowest ids) set to -inf."""
    if not truncates(top_k, top_p):
        return z_NV
    kept = truncation(z_NV, top_k, top_p)
    c = kept.cutoff.unsqueeze(-1)
    tied = z_NV == c
    return z_NV.masked_fill((z_NV < c) | (tied & ~_keep_first(tied, kept.at_cutoff)), float("-inf"))


class Truncation(NamedTuple):
    """A kept set as the trainer's softmax applies it, the target of each position always kept: scores below
    ``cutoff`` get probability 0, and each token tied at the cutoff other than the target counts ``exp(tie_logw)``
    of itself (the share of them the sampler keeps). Its value is the kept set's whichever tied tokens it holds, and
    its gradient the average over them."""

    cutoff: torch.Tensor
    """[..., ] the smallest score kept."""
    tie_logw: torch.Tensor
    """[..., ] log of the share of the non-target tokens at ``cutoff`` that the sampler keeps (0: all; -inf: none)."""

    def apply(self, z_NV: torch.Tensor, target_N: torch.Tensor, here_N: torch.Tensor) -> torch.Tensor:
        """A copy of the scores as the truncated softmax weighs them; ``target_N``: each position's target as an
        index into these scores (a vocabulary slice), where ``here_N`` (it is in the slice). One [N, V] copy; the
        tied tokens' weights (a bool [N, V] more) only where some position drops some of its ties."""
        c = self.cutoff.unsqueeze(-1)
        z = z_NV.masked_fill(z_NV < c, float("-inf"))
        if bool((self.tie_logw != 0).any()):
            shared = z == c
            index = target_N.unsqueeze(-1)
            shared.scatter_(-1, index, shared.gather(-1, index) & ~here_N.unsqueeze(-1))  # the target counts whole
            torch.where(shared, c + self.tie_logw.unsqueeze(-1), z, out=z)
        return z


@torch.no_grad()
def target_truncation(z_NV: torch.Tensor, target_N: torch.Tensor, top_k: int, top_p: float) -> Truncation:
    """The sampler's kept set for the scores ``z_NV`` (the whole vocabulary) with each row's target kept: the sampler
    kept the token it drew, so where the trainer's scores put the target below the cutoff, the cutoff is lowered to
    it (every token down to the target kept)."""
    kept = truncation(z_NV, top_k, top_p)
    zt = z_NV.float().gather(-1, target_N.unsqueeze(-1)).squeeze(-1)
    below = zt < kept.cutoff
    tied = (z_NV.float() == kept.cutoff.unsqueeze(-1)).sum(-1)
    target_tied = (zt == kept.cutoff).long()
    share = (kept.at_cutoff - target_tied).double() / (tied - target_tied).clamp(min=1).double()
    tie_logw = torch.where(below | (tied == target_tied), 0.0, share.log()).float()
    return Truncation(torch.where(below, zt, kept.cutoff), tie_logw)
