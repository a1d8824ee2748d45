"""Adapters in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``): read for ``init_from``,
gathered from every rank and written for export."""

from __future__ import annotations

import json
import os

import torch

from megarl.config.schema import LoraConfig
from megarl.lora.adapters import hf_shape, local_factors, merge_tp, peft_key
from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
UNSUPPORTED = ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save",
               "lora_bias", "layer_replication")  # fmt: skip
"""PEFT options that change what the adapter computes; an adapter that sets one is refused."""


def read_peft_adapter(path: str, lora: LoraConfig, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The PEFT-named full factors of the adapter directory ``path``; one-line errors when it does not match
    ``actor.lora`` (rank, alpha, targets) or the model (layers, shapes)."""
    from safetensors.torch import load_file

    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"actor.lora.init_from: {path} has no {name} (a PEFT adapter directory has both)")
    with open(os.path.join(path, CONFIG_FILE)) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"actor.lora.init_from: {path} is a {config.get('peft_type')} adapter, not LoRA")
    other_math = [k for k in UNSUPPORTED if config.get(k)]
    if other_math:
        raise ValueError(
            f"actor.lora.init_from: {path} sets {', '.join(other_math)}, which megarl's adapters do not compute "
            "(plain LoRA: scaling alpha / r, every layer, no bias)"
        )
    alpha = lora.effective_alpha
    if config.get("r") != lora.rank or float(config.get("lora_alpha", -1)) != alpha:
        raise ValueError(
            f"actor.lora.init_from: {path} has r={config.get('r')}, lora_alpha={config.get('lora_alpha')} but "
            f"actor.lora has rank={lora.rank}, alpha={alpha}; set them to the adapter's"
        )
    targets = config.get("target_modules") or []
    if sorted(targets) != sorted(lora.target_modules):
        raise ValueError(
            f"actor.lora.init_from: {path} targets {sorted(targets)} but actor.lora.target_modules is "
            f"{sorted(lora.target_modules)}"
        )
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    out = {}
    for layer in range(spec.num_layers):
        for t in lora.target_modules:
            out_f, in_f = hf_shape(spec, t)
            for factor, shape in (("A", (lora.rank, in_f)), ("B", (out_f, lora.rank))):
                key = peft_key(layer, t, factor)
                if key not in tensors or tuple(tensors[key].shape) != shape:
                    got = tuple(tensors[key].shape) if key in tensors else "missing"
                    raise ValueError(f"actor.lora.init_from: {path}: {key} is {got}, expected {shape} for this model")
                out[key] = tensors[key].float()
    return out


def gather_adapters(chunk, spec: ModelSpec, layout: ParallelLayout) -> dict[str, torch.Tensor]:
    """Collective over the world: the full PEFT-named factors (DP replica 0's), on every rank."""
    import torch.distributed as dist

    c = layout.coords(dist.get_rank())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ((c.tp, c.pp, c.dp), {k: v.cpu() for k, v in local_factors(chunk).items()}))
    by_key: dict[tuple, dict[int, torch.Tensor]] = {}
    for (tp, _, dp), factors in everyone:
        if dp == 0:
            for key, value in factors.items():
                by_key.setdefault(key, {})[tp] = value
    return {
        peft_key(layer, t, f): merge_tp(spec, t, f, [parts[r] for r in sorted(parts)])
        for (layer, t, f), parts in sorted(by_key.items())
    }


def write_peft_adapter(path: str, tensors: dict[str, torch.Tensor], lora: LoraConfig, base_model: str = "") -> None:
    """A PEFT adapter directory that ``peft.PeftModel.from_pretrained(base, path)`` loads."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.effective_alpha,
        lora_dropout=0.0,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model or None,
    )
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, WEIGHTS_FILE))
