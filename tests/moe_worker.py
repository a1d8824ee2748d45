"""Runs inside each of 2 spawned ranks: the load-balancing loss of a tiny Qwen3-MoE against an fp64 oracle written
from the Switch Transformer formula, and the router gradient it adds at a coefficient."""

from __future__ import annotations

import torch

from megarl.backend.moe import LoadBalancing
from megarl.backend.setup import wrap_for_training
from megarl.backend.step import forward_backward, lm_loss, make_lm_micro_batches
from megarl.config.schema import OptimConfig
from megarl.models.builder import build_model_chunk
from megarl.parallel import megatron_shards as shards
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from tests.parity_worker import _full_weights, tiny_spec

PADDED = 5
"""The last positions of every micro-batch's second row are padding: out of the loss and of the load balancing."""


def oracle(hidden: torch.Tensor, weight: torch.Tensor, topk: int, valid: torch.Tensor) -> torch.Tensor:
    """E * sum_i f_i P_i in fp64 over the valid tokens: f_i the fraction of routed slots (token, choice) that went
    to expert i, P_i the mean router probability of expert i."""
    h, w = hidden.reshape(-1, hidden.shape[-1])[valid].double(), weight.double()
    probs = torch.softmax(h @ w.T, dim=-1)
    experts, tokens = w.shape[0], h.shape[0]
    chosen = torch.zeros(tokens, experts, dtype=torch.float64)
    for x in range(tokens):
        for i in probs[x].argsort(descending=True)[:topk]:
            chosen[x, i] = 1.0
    f = chosen.sum(0) / (tokens * topk)
    p = probs.sum(0) / tokens
    return experts * (f * p).sum()


def _micro_batches(spec) -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    mbs = make_lm_micro_batches(torch.randint(0, spec.vocab_size, (4, 17), generator=gen), micro_batch_size=2)
    for mb in mbs:
        mb["padding_mask"] = torch.zeros_like(mb["tokens"], dtype=torch.bool)
        mb["padding_mask"][1, -PADDED:] = True
        mb["loss_mask"][1, -PADDED:] = 0.0
    return mbs


def _router_grads(model, chunk, mbs, coefficient: float):
    """(this rank's kept losses, each router's gradient, each router's inputs per micro-batch) of one
    forward/backward at ``coefficient``."""
    balancing = LoadBalancing(chunk, coefficient)
    inputs = {id(r): [] for r in balancing.routers}
    handles = [r.register_forward_hook(lambda m, i, o: inputs[id(m)].append(i[0].detach().clone()))
               for r in balancing.routers]  # fmt: skip
    model.zero_grad_buffer()
    forward_backward(model, mbs, lm_loss)
    for h in handles:
        h.remove()
    for r in balancing.routers:
        r._forward_hooks.clear()
    grads = [r.weight.main_grad.detach().clone() for r in balancing.routers]
    return balancing.values, grads, [inputs[id(r)] for r in balancing.routers], balancing


def run_aux_loss() -> dict:
    spec = tiny_spec(moe=True)
    layout = ParallelLayout(dp=2)  # both ranks hold the whole batch (as the parity test's reference)
    init_distributed(layout, seed=1)
    chunk = build_model_chunk(spec, layout)
    local = shards.local_state_dict(_full_weights(spec, False), shards.StageInfo(0, 1, spec.num_layers), 0, 1)
    chunk.load_state_dict(local, strict=False)
    model, _ = wrap_for_training(chunk, OptimConfig(optimizer="sgd", lr=0.1, clip_grad=0.0))
    mbs = _micro_batches(spec)
    values0, grads0, inputs, balancing = _router_grads(model, chunk, mbs, 0.0)
    c = 0.01
    _, grads_c, _, _ = _router_grads(model, chunk, mbs, c)
    routers = balancing.routers
    want = [oracle(inputs[k][m], r.weight.detach(), spec.moe_top_k, ~mb["padding_mask"].T.reshape(-1))
            for m, mb in enumerate(mbs) for k, r in enumerate(routers)]  # fmt: skip (forward order)
    # the last routed layer's router: the term's gradient is c x the mean over micro-batches of d aux / d W
    # (no later layer's loss depends on it), with its inputs fixed
    w = routers[-1].weight.detach().double().requires_grad_()
    last = torch.stack([oracle(x, w, spec.moe_top_k, ~mb["padding_mask"].T.reshape(-1))
                        for x, mb in zip(inputs[-1], mbs)]).mean()  # fmt: skip
    (d_last,) = torch.autograd.grad(last, w)
    balancing.values = values0
    return {
        "kept": [float(v) for v in values0],
        "oracle": [float(v) for v in want],
        "logged": balancing.take(),
        "grad_added": (grads_c[-1].double() - grads0[-1].double()),
        "grad_want": c * d_last,
        "grad_scale": float(grads0[-1].abs().max()),
        "first_router_moved": float((grads_c[0] - grads0[0]).abs().max()),
    }
