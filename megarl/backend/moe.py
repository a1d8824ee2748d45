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

import contextlib
import functools

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


class RoutingReplay:
    """Rollout routing replay ("R3", ``actor.moe_routing_replay``): the experts the engine routed each token to
    (``Sample.routed_experts``, a micro-batch's ``routes``), against the routers of an actor chunk.

    ``replay=True`` (``rollout``; the chunk built with Megatron's ``moe_enable_routing_replay``, which gives each
    router a ``RouterReplay``): every forward routes each token to the engine's experts, the weights gathered from
    the router's own scores at them (``norm_topk_prob`` renormalises over those). A forward recomputed in the
    backward (``model.recompute``) replays its own micro-batch: each forward queues its routes, and once it returned
    the routers take them back in order (Megatron's ``REPLAY_BACKWARD``; 1F1B runs backwards in forward order).
    ``replay=False`` (``measure``): the routers route themselves.

    Either way every forward (not a recomputation) counts the (real position, routed layer) pairs where the
    router's own top-k set, from its scores, equals the engine's: ``take`` gives their share
    (``moe/routing_agreement``), and replaying, the share routed to exactly the engine's experts
    (``moe/routing_replayed``: 1 unless the replay missed). Megatron's tokens are sequence-major ([S, b]
    flattened): position ``s`` of sequence ``j`` is token ``s * b + j``."""

    def __init__(self, chunk: torch.nn.Module, moe_layers: list[int], replay: bool):
        from megatron.core.transformer.moe.router import TopKRouter

        self.replay = replay
        self.routers = [m for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.columns = [moe_layers.index(r.layer_number - 1) for r in self.routers]
        """Each local router's column in the routes (its index among the model's routed layers)."""
        if replay and any(r.router_replay is None for r in self.routers):
            raise ValueError("routing replay needs the actor built with moe_enable_routing_replay")
        self.targets: list[torch.Tensor | None] = [None] * len(self.routers)
        self.valid: torch.Tensor | None = None
        """The current forward's real positions (sequence-major); None outside a forward."""
        self.counts: list[torch.Tensor] = []
        """Per counted forward of a router: (pairs that agree, pairs routed to the engine's experts, real pairs), on
        the model's device (no sync)."""
        for i, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._compared, i))

    @contextlib.contextmanager
    def micro_batch(self, mb: dict):
        """Around one micro-batch's forward (``megarl.backend.step``): its routes into the routers."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routes, b, s = mb.get("routes"), *mb["tokens"].shape
        if routes is None and self.replay and not mb["padding_mask"].all():
            raise ValueError("actor.moe_routing_replay=rollout: these samples carry no engine routes (generated with "
                             "the option off?); nothing to replay")  # fmt: skip
        for i, (router, column) in enumerate(zip(self.routers, self.columns)):
            if routes is None:  # a lockstep filler (all padding): any experts
                target = torch.arange(router.topk, device=mb["tokens"].device).expand(s * b, router.topk)
            else:
                target = routes[:, :, column].transpose(0, 1).reshape(s * b, -1).long()
            self.targets[i] = target
            if self.replay:
                router.router_replay.set_target_indices(target)
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        self.valid = None if routes is None else ~mb["padding_mask"].transpose(0, 1).reshape(-1)
        try:
            yield
        finally:
            self.valid = None
            if self.replay:
                for router in self.routers:
                    router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def end_schedule(self) -> None:
        """After a schedule: the routers route themselves again, nothing queued."""
        for router in self.routers:
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    def _compared(self, i: int, router, inputs, output) -> None:
        if self.valid is None:  # a recomputation, a filler, or a forward outside ``micro_batch``
            return
        with torch.no_grad():
            used = output[1].nonzero()[:, 1].view(-1, router.topk)  # routing_map [tokens, experts]: the experts used
            own = used  # measuring, the router routed itself; replaying, its own choice is from its scores
            if self.replay:
                logits = router.gating(inputs[0]).view(-1, router.config.num_moe_experts)
                own = logits.topk(router.topk, dim=-1).indices.sort(dim=-1).values
            engine = self.targets[i].sort(dim=-1).values
            same = (own == engine).all(dim=-1) & self.valid
            replayed = (used == engine).all(dim=-1) & self.valid
        self.counts.append(torch.stack([same.sum(), replayed.sum(), self.valid.sum()]))

    def take(self) -> dict[str, float]:
        """Collective over the model's pipeline stages and data-parallel ranks: the shares of the (real position,
        routed layer) pairs counted since the last call (the ``moe/`` metrics above); then forgets them."""
        from megatron.core import parallel_state as ps

        counts, self.counts = self.counts, []
        total = torch.stack(counts).sum(0).double().cpu() if counts else torch.zeros(3, dtype=torch.float64)
        for group in (ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_group()):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        share = (total[:2] / total[2]).tolist() if total[2] > 0 else [float("nan")] * 2
        return {"moe/routing_agreement": share[0], **({"moe/routing_replayed": share[1]} if self.replay else {})}
