"""A random, non-zero PEFT adapter for a tiny HF model, written by peft itself (tests compare megarl's LoRA with it)."""

from __future__ import annotations

import torch


def write_random_adapter(hf_dir: str, path: str, targets, rank: int = 4, alpha: int = 8, seed: int = 9) -> str:
    """Every factor random (a fresh adapter has B = 0 and would change nothing); returns ``path``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), init_lora_weights=False),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if "lora_A" in name else 0.05))
    model.save_pretrained(path)
    return path
