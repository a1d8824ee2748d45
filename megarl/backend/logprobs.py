"""The actor's log-probabilities of given tokens, through Megatron's schedule (TP vocab-parallel, PP-aware).

log p(token_t | tokens_<t) under softmax(logits / temperature) over the model's true vocabulary (the padding rows
megarl adds to the embedding are masked out, as vLLM and HF never sample them), restricted to the tokens the
sampler's top-k / top-p keep when it truncates (``megarl.algos.sampling``). This is the quantity the rollout engines
return (vLLM ``processed_logprobs``), so a PPO ratio compares like with like.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algos import vocab_parallel_logprobs
from megarl.algos.sampling import Truncation, target_truncation, truncates
from megarl.backend.step import run_schedule


def tp_all_reduce(op):
    """A non-differentiable all-reduce of a copy over this rank's TP group (the input itself without TP)."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        if tp > 1:
            x = x.detach().clone()
            dist.all_reduce(x, op=op, group=group)
        return x

    return all_reduce


CUTOFF_POSITIONS = 512
"""Positions whose whole-vocabulary logits ``tp_truncation`` holds at once."""


@torch.no_grad()
def tp_truncation(
    logits_BSV: torch.Tensor, targets_BS: torch.Tensor, temperature: float, true_vocab: int, top_k: int, top_p: float
) -> Truncation | None:
    """The sampler's kept set on logits / T at every position (``target_truncation``: vLLM's rule, the target kept;
    None when top_k / top_p truncate nothing). Top-p ranks the whole vocabulary: with TP, ``CUTOFF_POSITIONS``
    positions' logits at a time are gathered over the TP group (no gradient), which bounds the transient copies to a
    few [CUTOFF_POSITIONS, vocabulary] fp32 tensors."""
    if not truncates(top_k, top_p):
        return None
    from megatron.core import parallel_state as ps

    tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    flat_NV, targets_N = logits_BSV.reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1)
    parts_of = []
    for start in range(0, flat_NV.shape[0], CUTOFF_POSITIONS):
        chunk = flat_NV[start : start + CUTOFF_POSITIONS].contiguous()
        parts = [chunk]
        if tp > 1:
            parts = [torch.empty_like(chunk) for _ in range(tp)]
            dist.all_gather(parts, chunk, group=group)
        z = torch.cat(parts, -1)[..., :true_vocab].float()
        z = z / temperature if temperature != 1 else z  # the same arithmetic as the log-probs' pass
        target = targets_N[start : start + CUTOFF_POSITIONS].clamp(0, true_vocab - 1)
        parts_of.append(target_truncation(z, target, top_k, top_p))
    return Truncation(*(torch.cat(field).reshape(targets_BS.shape) for field in zip(*parts_of)))


def tp_logprobs(
    logits_BSV: torch.Tensor,
    targets_BS: torch.Tensor,
    temperature: float,
    true_vocab: int,
    with_entropy: bool = False,
    truncation_BS: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) under softmax(logits / T) over the true vocabulary from this TP rank's vocabulary slice
    (``megarl.algos.vocab_parallel_logprobs``: the slice's softmax, no logits gathered, the padded rows excluded);
    differentiable. ``with_entropy``: also the entropy of the same softmax, for a metric (no gradient).
    ``truncation_BS`` (``tp_truncation``): the softmax over the sampler's kept tokens only."""
    from megatron.core import parallel_state as ps

    return vocab_parallel_logprobs(
        logits_BSV,
        targets_BS,
        vocab_start=ps.get_tensor_model_parallel_rank() * logits_BSV.shape[-1],
        true_vocab=true_vocab,
        temperature=temperature,
        all_reduce_sum=tp_all_reduce(dist.ReduceOp.SUM),
        all_reduce_max=tp_all_reduce(dist.ReduceOp.MAX),
        with_entropy=with_entropy,
        truncation_BT=truncation_BS,
    )


def logprobs_from_logits(
    logits_BSV: torch.Tensor,
    targets_BS: torch.Tensor,
    temperature: float,
    true_vocab: int,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """log p(target) under softmax(logits / T) over the true vocabulary (over the tokens top-k / top-p keep, when
    they truncate), from this TP rank's vocabulary slice. Differentiable; call it inside Megatron's schedule."""
    truncation = tp_truncation(logits_BSV, targets_BS, temperature, true_vocab, top_k, top_p)
    return tp_logprobs(logits_BSV, targets_BS, temperature, true_vocab, truncation_BS=truncation)[0]


def forward_per_token(model, micro_batches: list[dict], per_token, replay=None) -> list[torch.Tensor]:
    """Collective over the model-parallel group: ``per_token(micro_batch, output) -> [b, S]`` for every micro-batch,
    forward only, returned on every TP and PP rank of this data-parallel replica (host tensors). Positions before
    the micro-batch's ``scored_from`` (``run_schedule``) are 0. ``replay``: as ``run_schedule``'s."""
    from megatron.core import parallel_state as ps

    def loss_fn(mb, output):
        values = torch.nn.functional.pad(per_token(mb, output).detach(), (mb.get("scored_from", 0), 0))
        return values.sum() * 0, {"values": values}

    with torch.no_grad():
        reported = run_schedule(model, micro_batches, loss_fn, forward_only=True, replay=replay)
    holder = [[r["values"].cpu() for r in reported] if ps.is_pipeline_last_stage() else None]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(
            holder, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
    return holder[0]


def token_logprobs(
    model,
    sequences: torch.Tensor,
    *,
    temperature: float,
    true_vocab: int,
    micro_batch_size: int = 1,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Collective over the model-parallel group: ``[N, T-1]`` log-probabilities of ``sequences[:, 1:]``.

    ``sequences`` is ``[N, T]`` token ids (right-padded sequences are fine: padding positions are computed and can
    be masked by the caller). The result is the same on every TP and PP rank of this data-parallel replica."""
    inputs, targets = sequences[:, :-1], sequences[:, 1:]
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    micro_batches = [
        {
            "tokens": inputs[i : i + micro_batch_size].contiguous(),
            "position_ids": positions[i : i + micro_batch_size].contiguous(),
            "targets": targets[i : i + micro_batch_size].contiguous(),
        }
        for i in range(0, inputs.shape[0], micro_batch_size)
    ]
    per_mb = forward_per_token(
        model,
        micro_batches,
        lambda mb, logits: logprobs_from_logits(logits, mb["targets"], temperature, true_vocab, top_k, top_p),
    )
    return torch.cat(per_mb)


def logprob_mismatch(rollout_logprobs: list[list[float]], train_logprobs: list[torch.Tensor]) -> dict[str, float]:
    """mean and max over generated tokens of |logp_rollout - logp_train|: the check that the engine really holds
    the actor's weights (and, later, the basis of truncated importance sampling)."""
    diffs = torch.cat(
        [(torch.tensor(r, dtype=torch.float64) - t.double()).abs() for r, t in zip(rollout_logprobs, train_logprobs)]
    )
    return {"logprob_mismatch_mean": float(diffs.mean()), "logprob_mismatch_max": float(diffs.max())}
