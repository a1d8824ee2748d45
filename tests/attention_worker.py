"""Runs inside every spawned rank: the same weights and right-padded micro-batches through the ``sdpa`` and the
``unfused`` core attention at one layout, or with and without ``megarl.compat.megatron_speed``; reports how far
logits (at the positions that score a response token) and gradients of the actor's loss differ."""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmarks.train_step import megatron_speed_off
from megarl.backend.batch import Sequence, micro_batches
from megarl.backend.setup import wrap_for_training
from megarl.backend.step import run_schedule
from megarl.config.schema import OptimConfig
from megarl.models.builder import build_model_chunk
from megarl.models.swiglu import SwiGLU
from megarl.parallel import megatron_shards as shards
from megarl.parallel.init import init_distributed
from tests.activation_worker import Case, actor_loss
from tests.parity_worker import _full_weights

PROMPT_LEN = 3
"""Every sequence's: the loss scores positions >= 2 (``collate``'s ``scored_from``)."""


def _padded_batches(spec) -> list[dict]:
    """Sequences of different lengths, two per micro-batch, right-padded to each micro-batch's longest."""
    gen = torch.Generator().manual_seed(5)
    seqs = [Sequence(torch.randint(0, spec.vocab_size, (ln,), generator=gen).tolist(), prompt_len=PROMPT_LEN)
            for ln in (17, 9, 12, 5)]  # fmt: skip
    batches = micro_batches(seqs, [[0, 1], [2, 3]])
    for mb in batches:  # a per-sequence advantage, and the engine's log-probs (unused by the on-policy loss)
        mb["advantages"] = torch.linspace(-1, 1, len(mb["tokens"]))[:, None].expand_as(mb["loss_mask"]).contiguous()
        mb["rollout_logp"] = torch.zeros_like(mb["loss_mask"])
    return batches


def _run(spec, layout, attention: str, dtype: str, views: list | None = None, firsts: list | None = None,
         fused: list | None = None):
    """This rank's logits at the scored positions (per micro-batch, on the last stage) and gradients of one
    forward/backward; ``views`` collects whether each micro-batch's logits reached the loss as a view (not a copy)
    of the output layer's, ``firsts`` the first position the output layer computed (and the torch function mode
    the loss ran in), ``fused`` how many weights
    got their gradient accumulated into ``main_grad`` by the GEMM and how many MLPs ran megarl's SwiGLU."""
    c = layout.coords(dist.get_rank())
    chunk = build_model_chunk(spec, layout, attention=attention, dtype=dtype)
    local = shards.local_state_dict(
        _full_weights(spec, False), shards.StageInfo(c.pp, layout.pp, spec.num_layers), c.tp, layout.tp,
        tied_embeddings=spec.tie_word_embeddings, value_head=False,
    )  # fmt: skip
    chunk.load_state_dict(local, strict=False)
    model, _ = wrap_for_training(chunk, OptimConfig(optimizer="sgd", lr=0.1))
    batches = _padded_batches(spec)
    logits, loss = [], actor_loss(Case(layout, 2, batches[0]["tokens"].shape[1], micro_batches=2), spec.vocab_size)

    def recording_loss(mb, logits_BSV):
        if views is not None:
            views.append(logits_BSV._base is not None)
            firsts.append((mb["scored_from"], _mode_name()))
        logits.append(logits_BSV[:, PROMPT_LEN - 1 - mb["scored_from"] :].detach().float().clone())
        return loss(mb, logits_BSV)

    graph = []  # per micro-batch: the torch function mode the forward ran in, the TP mappings in its graph
    hook = chunk.register_forward_hook(lambda module, args, output: graph.append(_mode_and_mappings(output)))
    try:
        run_schedule(model, batches, recording_loss)
    finally:
        hook.remove()
    grads = {n: p.main_grad.detach().clone() for n, p in chunk.named_parameters()}
    if fused is not None:
        swiglu = [m for m in chunk.modules() if type(m).__name__ == "MLP" and isinstance(m.activation_func, SwiGLU)]
        from megatron.core.models.common.embeddings import rope_utils

        norms = [m for m in chunk.modules() if type(m).__name__ == "_RMSNormOnCPU"]
        rope = int(getattr(rope_utils._apply_rotary_pos_emb_bshd, "megarl_patched", False))  # as the forward ran
        swiglus = len(swiglu) if chunk.config.use_te_activation_func else 0
        fused.append((sum(bool(getattr(p, "grad_added_to_main_grad", False)) for p in chunk.parameters()), swiglus,
                      len(norms), rope, *graph[0]))  # fmt: skip
        assert len(set(graph)) == 1, graph  # every micro-batch alike
    return logits, grads


_TP_MAPPINGS = ("_CopyToModelParallelRegionBackward", "_ReduceFromModelParallelRegionBackward")


def _mode_and_mappings(output: torch.Tensor) -> tuple[str | None, int]:
    """The torch function mode active now (a forward hook: the one the forward ran in), and how many of Megatron's
    TP mappings (``_CopyToModelParallelRegion``, ``_ReduceFromModelParallelRegion``) ``output``'s graph holds."""
    return _mode_name(), sum(name in _TP_MAPPINGS for name in graph_nodes(output))


def _mode_name() -> str | None:
    """The class name of the torch function mode active now (None: none)."""
    from torch.overrides import _get_current_function_mode

    mode = _get_current_function_mode()
    return type(mode).__name__ if mode is not None else None


def graph_nodes(output: torch.Tensor) -> list[str]:
    """The type names of the autograd nodes ``output``'s graph holds, each node once."""
    seen, todo, names = set(), [output.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def _lm_losses(spec, layout, dtype: str) -> torch.Tensor | None:
    """Megatron's own per-token cross-entropy (``labels=``) of two sequences in one micro-batch (last stage)."""
    from megarl.compat.cpu import megatron_mode

    c = layout.coords(dist.get_rank())
    chunk = build_model_chunk(spec, layout, dtype=dtype)
    chunk.load_state_dict(shards.local_state_dict(
        _full_weights(spec, False), shards.StageInfo(c.pp, layout.pp, spec.num_layers), c.tp, layout.tp,
        tied_embeddings=spec.tie_word_embeddings, value_head=False), strict=False)  # fmt: skip
    tokens = torch.randint(0, spec.vocab_size, (2, 13), generator=torch.Generator().manual_seed(9))
    if layout.pp > 1:  # the labels path on one stage only: the loss needs no schedule
        return None
    with megatron_mode(), torch.no_grad():
        return chunk(tokens[:, :-1], torch.arange(12).expand(2, -1), None, labels=tokens[:, 1:]).float()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _differences(new: tuple, reference: tuple) -> dict:
    """Max relative differences of ``new``'s (logits, grads) from ``reference``'s over this layout's ranks."""
    (logits_n, grads_n), (logits_r, grads_r) = new, reference
    assert grads_n.keys() == grads_r.keys()
    mine = {
        "logits": max((_relative(n, r) for n, r in zip(logits_n, logits_r)), default=0.0),
        "grads": max(_relative(grads_n[n], grads_r[n]) for n in grads_r),
        "grad_norm": max(grads_r[n].abs().max().item() for n in grads_r),
        "logit_batches": len(logits_r),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {
        "logits": max(e["logits"] for e in everyone),
        "grads": max(e["grads"] for e in everyone),
        "grad_norm": min(e["grad_norm"] for e in everyone),
        "logit_batches": sum(e["logit_batches"] for e in everyone),
    }


def compare(spec, layout, dtype: str = "float32") -> dict:
    """Max relative differences (max |sdpa - unfused| / max |unfused|) over this layout's ranks."""
    init_distributed(layout, seed=1)
    return _differences(_run(spec, layout, "sdpa", dtype), _run(spec, layout, "unfused", dtype))


def compare_speedups(spec, layout, dtype: str = "float32") -> dict:
    """Max relative differences with ``megarl.compat.megatron_speed`` against without it, and whether the loss got
    the output layer's logits as views with it and as copies without it, and the first position it computed (on
    every rank of the last stage)."""
    init_distributed(layout, seed=1)
    views, views_off, firsts, firsts_off, fused, fused_off = [], [], [], [], [], []
    new, lm = _run(spec, layout, "sdpa", dtype, views, firsts, fused), _lm_losses(spec, layout, dtype)
    with megatron_speed_off():
        reference = _run(spec, layout, "sdpa", dtype, views_off, firsts_off, fused_off)
        lm_off = _lm_losses(spec, layout, dtype)
    lm_diff = None if lm is None else _relative(lm, lm_off)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (views, views_off, lm_diff, firsts, firsts_off, fused, fused_off))
    lm_diffs = [e[2] for e in everyone if e[2] is not None]
    keys = ((0, "views"), (1, "views_off"), (3, "firsts"), (4, "firsts_off"), (5, "fused"), (6, "fused_off"))
    gathered = {key: [x for e in everyone for x in e[i]] for i, key in keys}
    return {**_differences(new, reference), "lm_loss": max(lm_diffs) if lm_diffs else None, **gathered}


def compare_cases(cases: list[tuple], speedup_cases: list[tuple] = ()) -> tuple[list[dict], list[dict]]:
    return [compare(*case) for case in cases], [compare_speedups(*case) for case in speedup_cases]
