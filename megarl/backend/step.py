"""One optimizer step over micro-batches through Megatron's pipeline schedule (1F1B for PP > 1).

A micro-batch is a dict of [batch, seq] tensors: ``tokens``, ``position_ids``, optionally ``labels``,
``padding_mask`` (True past each sequence's end) and whatever the loss needs, and optionally ``scored_from``: the
first position the loss scores (the output layer skips the positions before it where it can, and the loss gets its
fields from the same position: ``positions_from``). With
labels, a GPTModel returns the per-token cross-entropy (= -log p of the label), computed vocab-parallel without
gathering logits; a critic returns values [batch, seq, 1].
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from megarl.compat.cpu import megatron_mode, outside_megatron_mode
from megarl.compat.megatron_speed import logits_from

LossFn = Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(micro_batch, model_output) -> (scalar loss for backward, metrics to report)."""


def lm_loss(micro_batch: dict, token_nll_BS: torch.Tensor):
    """Mean next-token cross-entropy over the tokens where ``loss_mask`` is 1."""
    mask_BS = micro_batch["loss_mask"].to(token_nll_BS.dtype)
    loss = (token_nll_BS * mask_BS).sum() / mask_BS.sum().clamp(min=1)
    return loss, {"loss": loss.detach().clone()}  # clone: the schedule divides `loss` in place


MEAN, SUM = "mean", "sum"


def forward_backward(
    model, micro_batches: list[dict], loss_fn: LossFn, *, forward_only: bool = False, reduce: str = MEAN, replay=None
) -> dict:
    """Run every micro-batch forward (and backward) through Megatron's schedule.

    Returns the metrics reduced over micro-batches and data-parallel ranks, identical on every rank: averaged
    (``reduce="mean"``), or summed (``"sum"``: for metrics the loss function already normalised globally) with keys
    starting ``max/`` taking the maximum instead.
    """
    from megatron.core import parallel_state as ps

    reported = run_schedule(model, micro_batches, loss_fn, forward_only=forward_only, replay=replay)
    return _reduce_metrics(reported, ps, reduce)


def run_schedule(model, micro_batches: list[dict], loss_fn: LossFn, *, forward_only: bool = False, replay=None
                 ) -> list[dict]:  # fmt: skip
    """Megatron's schedule over the micro-batches; returns each micro-batch's metrics dict on the last stage
    (an empty list on other stages). ``replay`` (``megarl.backend.moe.RoutingReplay``): each micro-batch's
    ``routes`` into the routers around its forward."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    def forward_step(data_iterator, model_chunk):
        device = next(model_chunk.parameters()).device  # batches are built on the host; the model may be on a GPU
        mb = {
            k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in next(data_iterator).items()
        }
        wanted = mb.get("scored_from", 0) if "labels" not in mb else 0  # Megatron's own loss scores every position
        # the model's forward and the loss as on a GPU: without the CPU shim's mode, a Python call per torch call
        # (compat.cpu); Megatron's schedule calls the loss inside the mode
        with logits_from(model_chunk, wanted) as first, outside_megatron_mode(), routes_of(mb):
            output = model_chunk(mb["tokens"], mb["position_ids"], None, labels=mb.get("labels"), **routing(mb))
        return output, outside_megatron_mode()(partial(loss_fn, positions_from(mb, first)))

    def routing(mb: dict) -> dict:  # routed-expert layers leave padding out of their load balancing (backend.moe)
        return {"padding_mask": mb["padding_mask"]} if moe and "padding_mask" in mb else {}

    def routes_of(mb: dict):
        return replay.micro_batch(mb) if replay is not None else contextlib.nullcontext()

    moe = getattr(get_model_config(model[0] if isinstance(model, list) else model), "num_moe_experts", None)
    batch_size, seq_length = micro_batches[0]["tokens"].shape
    try:
        with megatron_mode():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=model,
                num_microbatches=len(micro_batches),
                seq_length=seq_length,
                micro_batch_size=batch_size,
                forward_only=forward_only,
            )
    finally:
        if replay is not None:
            replay.end_schedule()


def positions_from(micro_batch: dict, first: int) -> dict:
    """The micro-batch as the loss sees logits computed from position ``first`` on: every [b, S] field sliced to
    [b, S - first] and ``scored_from`` set to ``first`` (the position of the slice's column 0)."""
    if first == 0 and "scored_from" not in micro_batch:
        return micro_batch
    shape = micro_batch["tokens"].shape
    sliced = {
        k: v[:, first:] if isinstance(v, torch.Tensor) and v.shape[:2] == shape else v for k, v in micro_batch.items()
    }
    return {**sliced, "scored_from": first}


def _reduce_metrics(reported: list[dict], ps, reduce: str = MEAN) -> dict:
    """Reduce per-micro-batch metrics (present on the last stage only) over micro-batches, then share them with every
    stage and reduce over DP ranks (see ``forward_backward``)."""
    holder = [None]
    if ps.is_pipeline_last_stage():
        keys = sorted(reported[0])
        stacked = {k: torch.stack([m[k].double().reshape(()) for m in reported]) for k in keys}
        holder[0] = {
            k: float(v.max() if k.startswith("max/") else (v.sum() if reduce == SUM else v.mean()))
            for k, v in stacked.items()
        }
    if ps.get_pipeline_model_parallel_world_size() > 1:
        pp_group = ps.get_pipeline_model_parallel_group()
        dist.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
    metrics = holder[0]
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        group = ps.get_data_parallel_group()
        keys = sorted(metrics)
        sums = [k for k in keys if not k.startswith("max/")]
        maxes = [k for k in keys if k.startswith("max/")]
        summed = torch.tensor([metrics[k] for k in sums], dtype=torch.float64)
        dist.all_reduce(summed, group=group)
        metrics = {k: float(v) / (dp if reduce == MEAN else 1) for k, v in zip(sums, summed)}
        if maxes:
            top = torch.tensor([holder[0][k] for k in maxes], dtype=torch.float64)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            metrics.update({k: float(v) for k, v in zip(maxes, top)})
    return metrics


class NonFiniteUpdate(FloatingPointError):
    """An optimizer step was skipped because its loss or gradients were not finite (weights and optimizer state
    are unchanged). Raised on every rank together."""


def _non_finite(model, metrics: dict) -> str | None:
    """Why this step must not be applied (the same answer on every rank), or None."""
    bad_metrics = sorted(k for k, v in metrics.items() if not math.isfinite(v))
    grads = [b.grad_data for b in model.buffers + model.expert_parallel_buffers]  # Megatron DDP's grad buffers
    # a sum is NaN or inf exactly when an element is (or when finite gradients sum past 3e38, which no update
    # survives either): one reduction instead of isfinite's four passes over every gradient
    sums = [g.sum(dtype=torch.float32) for g in grads]
    finite = torch.isfinite(torch.stack(sums)).all() if sums else torch.tensor(True)
    flags = torch.tensor([float(bool(bad_metrics)), float(not finite.item())])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if not flags.any():
        return None
    parts = []
    if flags[0]:
        parts.append("non-finite " + (", ".join(bad_metrics) if bad_metrics else "metrics on another rank"))
    if flags[1]:
        parts.append("non-finite gradients")
    return " and ".join(parts)


def train_step(model, optimizer, micro_batches: list[dict], loss_fn: LossFn, *, reduce: str = MEAN, replay=None
               ) -> dict:  # fmt: skip
    """Zero grads, forward/backward all micro-batches, take one optimizer step. Returns metrics incl. grad_norm and
    lr (metrics reduced as in ``forward_backward``). Raises ``NonFiniteUpdate`` instead of stepping when a metric
    (the loss) or a gradient is NaN/inf anywhere."""
    with megatron_mode():
        model.zero_grad_buffer()
        optimizer.zero_grad()
    metrics = forward_backward(model, micro_batches, loss_fn, reduce=reduce, replay=replay)
    reason = _non_finite(model, metrics)
    if reason is not None:
        with megatron_mode():
            model.zero_grad_buffer()
            optimizer.zero_grad()
        raise NonFiniteUpdate(reason)
    with megatron_mode():
        ok, grad_norm, _ = optimizer.step()
    if not ok:  # fp16 loss scaling found inf/nan (and skipped the step itself)
        raise NonFiniteUpdate("inf/nan gradients (loss scaler)")
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["lr"] = float(optimizer.param_groups[0]["lr"])
    return metrics


def make_lm_micro_batches(tokens_NT: torch.Tensor, micro_batch_size: int) -> list[dict]:
    """Split next-token training sequences [N, T+1] into micro-batches of inputs [mbs, T] and labels [mbs, T]."""
    inputs, labels = tokens_NT[:, :-1], tokens_NT[:, 1:]
    position_ids = torch.arange(inputs.shape[1]).expand_as(inputs)
    return [
        {
            "tokens": inputs[i : i + micro_batch_size].contiguous(),
            "labels": labels[i : i + micro_batch_size].contiguous(),
            "position_ids": position_ids[i : i + micro_batch_size].contiguous(),
            "loss_mask": torch.ones_like(labels[i : i + micro_batch_size], dtype=torch.float32),
        }
        for i in range(0, tokens_NT.shape[0], micro_batch_size)
    ]
