"""The load-balancing loss of routed-expert layers: Megatron's switch loss, computed by megarl at any coefficient.

Megatron's router computes its auxiliary loss only when ``moe_aux_loss_coeff > 0`` (``router.py``), so a run at
coefficient 0 could not log it. ``LoadBalancing`` hooks every router of a model chunk instead (Megatron's own stays
off: ``megarl.models.builder``): each training forward of a router computes, from that micro-batch's router logits
in fp32 and its non-padding tokens (``GPTModel``'s ``padding_mask``, which ``megarl.backend.step`` passes),

    aux = E / (k T^2) * sum_i P_i N_i,   P_i = sum_x softmax(logits_x)_i,   N_i = #{x : i in top-k(x)}

(E experts, top-k routing, T valid tokens; the Switch Transformer loss as ``switch_load_balancing_loss_func``
writes it), keeps its value, and with a coefficient ``c > 0`` attaches ``c * aux`` to the router's output through
Megatron's ``MoEAuxLossAutoScaler``: its gradient enters the backward where the layer is (any pipeline stage),
scaled by the schedule as the main loss is (1 / micro-batches), so the objective is the main loss plus ``c`` times
each layer's mean over micro-batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def switch_load_balancing_loss(logits: torch.Tensor, topk: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The switch load-balancing loss of router logits [tokens, experts] over the ``valid`` tokens (bool [tokens];
    None: all), in fp32."""
    scores = torch.softmax(logits.float(), dim=-1)
    routed = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=-1).indices, 1.0)
    if valid is not None:
        keep = valid.reshape(-1, 1).to(scores.dtype)
        scores, routed = scores * keep, routed * keep
    tokens = routed.sum() / topk
    experts = logits.shape[-1]
    return experts / (topk * tokens.clamp(min=1) ** 2) * (scores.sum(0) * routed.sum(0)).sum()


class LoadBalancing:
    """Hooks on every router of ``chunk``: each training forward's loss per layer, attached at ``coefficient``."""

    def __init__(self, chunk: torch.nn.Module, coefficient: float = 0.0):
        from megatron.core.transformer.moe.router import TopKRouter

        self.coefficient = coefficient
        self.scale = 1.0
        """The attached term's weight on this rank (``megarl.backend.update.ppo_updates`` sets it per mini-batch):
        Megatron's schedule weighs each micro-batch's term by 1 / this rank's micro-batches and DDP averages over DP,
        so local micro-batches x DP / the mini-batch's micro-batches makes it the mini-batch's mean."""
        self.values: list[torch.Tensor] = []
        """This rank's losses since ``take``: one per routed layer and micro-batch (detached)."""
        self.counted: list[torch.Tensor] = []
        """Beside each value: 1 where its micro-batch had a valid token, 0 for a lockstep filler (all padding)."""
        self.routers = [m for m in chunk.modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.register_forward_hook(self._routed)

    def _routed(self, router, inputs, output):
        if not (router.training and torch.is_grad_enabled()):
            return None
        hidden, padding = inputs[0], inputs[1] if len(inputs) > 1 else None  # MoELayer.route passes both
        valid = None if padding is None else ~padding.reshape(-1)
        loss = switch_load_balancing_loss(router.gating(hidden).view(-1, router.config.num_moe_experts),
                                          router.topk, valid)  # fmt: skip
        self.values.append(loss.detach())
        self.counted.append(torch.ones((), device=loss.device) if valid is None else valid.any().double())  # no sync
        if self.coefficient == 0:
            return None
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        probs, routing_map = output
        return MoEAuxLossAutoScaler.apply(probs, self.coefficient * self.scale * loss), routing_map

    def take(self) -> float:
        """Collective over the model's pipeline stages and data-parallel ranks: the mean of the losses every rank
        kept since the last call (over routed layers, micro-batches and data-parallel ranks; lockstep fillers are not
        counted), then forgets them."""
        from megatron.core import parallel_state as ps

        def summed(values: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(values).double().sum().cpu() if values else torch.zeros((), dtype=torch.float64)

        total = torch.stack([summed(self.values), summed(self.counted)])
        self.values, self.counted = [], []
        for group in (ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        return float(total[0] / total[1].clamp(min=1))
