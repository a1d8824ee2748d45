"""LoRA in training checkpoints: the adapters (under their PEFT names, so any layout can load them) and, through
them, their optimizer state; the frozen base is not saved, only its fingerprint, checked on resume."""

from __future__ import annotations

import math

import torch

from megarl.lora.adapters import COLUMN, lora_layers, peft_key
from megarl.models.adapter import local_spec_names

KEY_PREFIX = "lora."
"""A checkpoint's adapter keys are this + the PEFT name (layout-independent)."""
FINGERPRINT_REL_TOL = 1e-9
"""Two fingerprints of the same weights differ only by the float64 summation order of another layout."""


def adapter_sharded_state(chunk, prefix: str = "") -> dict:
    """The dist-checkpoint state of ``chunk``'s adapters: ``{prefix}lora.<PEFT name>`` -> ShardedTensor over the
    live parameters (the split factor sharded over TP on its split axis, the whole one replicated)."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    out = {}
    for layer, _, module in lora_layers(chunk):
        if not hasattr(module, "lora"):
            continue
        ad = module.lora
        for t in ad.A:
            for factor, param in (("A", ad.A[t]), ("B", ad.B[t])):
                key = f"{prefix}{KEY_PREFIX}{peft_key(layer, t, factor)}"
                split = (ad.style == COLUMN and factor == "B") or (ad.style != COLUMN and factor == "A")
                out[key] = (
                    make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=0 if factor == "B" else 1)
                    if split
                    else make_sharded_tensor_for_checkpoint(param, key)
                )
    return out


def load_adapter_state(chunk, loaded: dict, prefix: str = "") -> None:
    """Copy loaded adapter tensors (``adapter_sharded_state``'s keys) into ``chunk``'s adapters."""
    expected = adapter_sharded_state(chunk, prefix)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"the checkpoint has no adapter {missing[0]} (saved without LoRA, or other target_modules?)")
    with torch.no_grad():
        for key, sharded in expected.items():
            sharded.data.copy_(loaded[key])


def base_fingerprint(chunk) -> dict[str, list[float]]:
    """Collective: per frozen base tensor (global layer names), the float64 sum and sum of squares of the whole
    tensor, independent of the layout up to summation order. Resume compares it with the checkpoint's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local = {}
    offset = _layer_offset(chunk)
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    for name, p in local_spec_names(chunk.named_parameters()).items():
        if p.requires_grad or (tied and name == "output_layer.weight"):  # a PP>1 copy of the tied embedding
            continue
        x = p.detach().double()
        split = getattr(p, "tensor_model_parallel", False)
        if split or ps.get_tensor_model_parallel_rank() == 0:  # a replicated tensor counts once
            local[_global_name(name, offset)] = [float(x.sum()), float((x * x).sum())]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (ps.get_data_parallel_rank(), local))
    out: dict[str, list[float]] = {}
    for dp_rank, part in everyone:
        if dp_rank == 0:
            for k, (s1, s2) in part.items():
                acc = out.setdefault(k, [0.0, 0.0])
                acc[0] += s1
                acc[1] += s2
    return dict(sorted(out.items()))


def _layer_offset(chunk) -> int:
    layers = list(chunk.decoder.layers)
    return layers[0].layer_number - 1 if layers else 0


def _global_name(name: str, offset: int) -> str:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def same_base(a: dict, b: dict) -> str | None:
    """None when the fingerprints match; else the first tensor that differs."""
    if a.keys() != b.keys():
        return f"other tensors ({len(a)} vs {len(b)})"
    for k in a:
        for x, y in zip(a[k], b[k]):
            if not math.isclose(x, y, rel_tol=FINGERPRINT_REL_TOL, abs_tol=1e-12):
                return k
    return None
