"""LoRA on the Megatron actor: adapters hooked onto the built model's TP linears, their PEFT format."""

from megarl.lora.adapters import adapter_modules, adapters_off, apply_lora, has_lora
from megarl.lora.peft_io import gather_adapters, read_peft_adapter, write_peft_adapter

__all__ = [
    "adapter_modules",
    "adapters_off",
    "apply_lora",
    "gather_adapters",
    "has_lora",
    "read_peft_adapter",
    "write_peft_adapter",
]
