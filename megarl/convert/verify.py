"""Logit parity: the same token batch through the HF model and the Megatron model loaded from a megarl checkpoint."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.backend.step import run_schedule
from megarl.checkpoint import format as ckpt
from megarl.checkpoint.weights import load_model
from megarl.compat.cpu import megatron_mode
from megarl.models.builder import DTYPES, build_model_chunk
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.init import init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.parallel.spawn import run_on_ranks

# max |logit difference| allowed, per dtype: fp32 differs only by summation order.
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}


def verification_tokens(vocab_size: int, batch: int = 2, seq: int = 48, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen)


def hf_logits(hf_dir: str, tokens_BS: torch.Tensor, dtype: str, score_head: bool = False) -> torch.Tensor:
    """The HF model's logits [B, S, vocab]; ``score_head`` (a reward model): its score at every position [B, S, 1]
    (HF pools one of them; the verification compares them all)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    with torch.no_grad():
        if score_head:
            model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=DTYPES[dtype])
            return model.score(model.base_model(tokens_BS).last_hidden_state).float()
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPES[dtype])
        return model(tokens_BS).logits.float()


def megatron_logits(chunk, tokens_BS: torch.Tensor, vocab_size: int, score_head: bool = False) -> torch.Tensor | None:
    """Full-vocabulary logits [B, S, vocab] on the last stage (None elsewhere), through Megatron's schedule; with a
    ``score_head`` the scalar head's output [B, S, 1] (replicated over TP: nothing to gather)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    position_ids = torch.arange(tokens_BS.shape[1]).expand_as(tokens_BS)
    micro_batches = [
        {"tokens": tokens_BS[i : i + 1], "position_ids": position_ids[i : i + 1]} for i in range(tokens_BS.shape[0])
    ]

    def keep_logits(mb, logits_BSV):
        full = logits_BSV if score_head else gather_from_tensor_model_parallel_region(logits_BSV)[..., :vocab_size]
        return logits_BSV.sum() * 0, {"logits": full.float()}

    with torch.no_grad(), megatron_mode():
        reported = run_schedule([chunk], micro_batches, keep_logits, forward_only=True)
    return torch.cat([r["logits"] for r in reported]) if reported else None


def verify_checkpoint(hf_dir: str, ckpt_dir: str, layout: ParallelLayout) -> dict:
    """Collective: load ``ckpt_dir`` at ``layout``, compare its logits with the HF model's; same result on every rank.

    Returns max_abs_diff, max_rel_diff (max |diff| / max |HF logit|), tolerance and passed.
    """
    meta = ckpt.read_meta(ckpt_dir)
    spec = spec_from_hf_config(meta["hf_config"])
    init_distributed(layout)
    chunk = build_model_chunk(spec, layout, dtype=meta["dtype"], init_weights=False, device="cpu")
    load_model(ckpt_dir, chunk)
    chunk.eval()
    tokens = verification_tokens(spec.vocab_size)
    logits = megatron_logits(chunk, tokens, spec.vocab_size, spec.score_head)
    rank = dist.get_rank()
    c = layout.coords(rank)
    result = None
    if logits is not None and c.tp == 0 and c.dp == 0:
        reference = hf_logits(hf_dir, tokens, meta["dtype"], spec.score_head)
        diff = (logits - reference).abs().max().item()
        tol = TOLERANCE[meta["dtype"]]
        result = {
            "max_abs_diff": diff,
            "max_rel_diff": diff / max(reference.abs().max().item(), 1e-12),
            "tolerance": tol,
            "passed": diff <= tol,
            "layout": str(layout),
            "tokens": list(tokens.shape),
        }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return next(r for r in gathered if r is not None)


def verify_on_ranks(hf_dir: str, ckpt_dir: str, layout: ParallelLayout) -> dict:
    """``verify_checkpoint`` on ``layout``'s ranks, started here (one rank: in this process); rank 0's result."""
    return run_on_ranks(verify_checkpoint, layout.world_size, hf_dir, ckpt_dir, layout)
