"""Runs inside every spawned rank: the same weights and right-padded micro-batches through the ``sdpa`` and the
``unfused`` core attention at one layout; reports how far logits and gradients of the actor's loss differ."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.config.schema import OptimConfig
from megarl.models.builder import build_model_chunk
from megarl.parallel import megatron_shards as shards
from megarl.parallel.init import init_distributed
from megarl.training.batch import Sequence, micro_batches
from megarl.training.setup import wrap_for_training
from megarl.training.step import run_schedule
from tests.activation_worker import Case, actor_loss
from tests.parity_worker import _full_weights


def _padded_batches(spec, n: int = 4) -> list[dict]:
    """Sequences of different lengths, two per micro-batch, right-padded to each micro-batch's longest."""
    gen = torch.Generator().manual_seed(5)
    seqs = [Sequence(torch.randint(0, spec.vocab_size, (ln,), generator=gen).tolist(), prompt_len=3)
            for ln in (17, 9, 12, 5)[:n]]  # fmt: skip
    batches, _ = micro_batches(seqs, max_tokens=0, micro_batch_size=2)
    for mb in batches:  # a per-sequence advantage, and the engine's log-probs (unused by the on-policy loss)
        mb["advantages"] = torch.linspace(-1, 1, len(mb["tokens"]))[:, None].expand_as(mb["loss_mask"]).contiguous()
        mb["rollout_logp"] = torch.zeros_like(mb["loss_mask"])
    return batches


def _run(spec, layout, attention: str, dtype: str):
    """This rank's logits (per micro-batch, on the last stage) and gradients of one forward/backward."""
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
        logits.append(logits_BSV.detach().float().clone())
        return loss(mb, logits_BSV)

    run_schedule(model, batches, recording_loss)
    grads = {n: p.main_grad.detach().clone() for n, p in chunk.named_parameters()}
    return logits, grads


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def compare(spec, layout, dtype: str = "float32") -> dict:
    """Max relative differences (max |sdpa - unfused| / max |unfused|) over this layout's ranks."""
    init_distributed(layout, seed=1)
    logits_s, grads_s = _run(spec, layout, "sdpa", dtype)
    logits_u, grads_u = _run(spec, layout, "unfused", dtype)
    assert grads_s.keys() == grads_u.keys()
    mine = {
        "logits": max((_relative(s, u) for s, u in zip(logits_s, logits_u)), default=0.0),
        "grads": max(_relative(grads_s[n], grads_u[n]) for n in grads_u),
        "grad_norm": max(grads_u[n].abs().max().item() for n in grads_u),
        "logit_batches": len(logits_u),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {
        "logits": max(e["logits"] for e in everyone),
        "grads": max(e["grads"] for e in everyone),
        "grad_norm": min(e["grad_norm"] for e in everyone),
        "logit_batches": sum(e["logit_batches"] for e in everyone),
    }


def compare_cases(cases: list[tuple]) -> list[dict]:
    return [compare(*case) for case in cases]
