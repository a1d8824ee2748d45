"""The current `megarl train` job: a short language-model run of the Megatron stack (actor built by megarl,
trained with Megatron DDP, optimizer and pipeline schedule). The RL loop replaces it when it lands."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tqdm import tqdm

from megarl.config.schema import MegarlConfig
from megarl.models.builder import build_model_chunk
from megarl.models.spec import ModelSpec
from megarl.parallel.init import destroy_distributed, init_distributed
from megarl.parallel.layout import ParallelLayout
from megarl.training.setup import wrap_for_training
from megarl.training.step import lm_loss, make_lm_micro_batches, train_step

CORPUS = (
    "megarl trains language models with reinforcement learning. The actor and critic are Megatron models; "
    "rollouts come from vLLM running on the same ranks. "
)


def corpus_batches(tokenizer_dir: str, seq_length: int, batch_size: int, vocab_size: int) -> torch.Tensor:
    """[batch_size, seq_length + 1] token windows cut from a small built-in text (no downloads)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_dir)(CORPUS * 8)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long).clamp(max=vocab_size - 1)
    starts = torch.arange(batch_size) * 7 % max(1, len(ids) - seq_length - 1)
    return torch.stack([ids[s : s + seq_length + 1] for s in starts])


def run_smoke(cfg: MegarlConfig, spec: ModelSpec) -> list[float]:
    """Train the actor on the built-in text for ``trainer.total_steps`` steps; returns the losses (every rank)."""
    par = cfg.actor.parallel
    layout = ParallelLayout(tp=par.tp, pp=par.pp, dp=par.dp)
    init_distributed(layout, seed=cfg.trainer.seed)
    rank = dist.get_rank()
    coords = layout.coords(rank)
    model, optimizer = wrap_for_training(
        build_model_chunk(spec, layout, dtype=cfg.model.dtype, transformer_impl=cfg.model.transformer_impl),
        cfg.actor.optim,
    )
    tokens = corpus_batches(cfg.model.path, cfg.actor.seq_length, cfg.actor.global_batch_size, spec.vocab_size)
    per_dp = cfg.actor.global_batch_size // par.dp
    micro_batches = make_lm_micro_batches(
        tokens[coords.dp * per_dp : (coords.dp + 1) * per_dp], cfg.actor.micro_batch_size
    )
    if rank == 0:
        print(
            f"[megarl] actor {spec.family} {spec.num_layers}x{spec.hidden_size} on {layout}, "
            f"{len(micro_batches)} micro-batches per step",
            flush=True,
        )
    losses = []
    steps = tqdm(range(cfg.trainer.total_steps), desc="train", disable=rank != 0)
    for step in steps:
        metrics = train_step(model, optimizer, micro_batches, lm_loss)
        losses.append(metrics["loss"])
        if rank == 0 and (step + 1) % cfg.trainer.log_every == 0:
            steps.write(
                f"[megarl] step {step + 1}/{cfg.trainer.total_steps} loss {metrics['loss']:.4f} "
                f"grad_norm {metrics['grad_norm']:.4f}"
            )
    destroy_distributed()
    return losses
