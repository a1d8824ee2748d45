"""LoRA adapters applied to a built Megatron GPT chunk, without touching model code.

Each targeted linear keeps its base weight (frozen) and gets a forward hook that adds ``scaling * B (A x)`` to its
output, ``x`` being what the linear multiplies: under Transformer Engine's layer spec ``linear_qkv`` and
``linear_fc1`` include the norm before them, and the adapters see its output (``linear_io``). Every HF target has
its own A and B, also inside the fused ``linear_qkv`` (q, k, v) and ``linear_fc1`` (gate, up): the target's
output lands in its block of the fused output, so the factors are PEFT's per-module ones.

Tensor parallelism (the factors' split follows the base linear's):
- column-parallel (``linear_qkv``, ``linear_fc1``): A replicated, B split on its output dimension like the fused
  weight's rows. Each TP rank sees only its output block, so A's gradient is partial per rank: ``A x`` passes through
  Megatron's ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), which sums it.
- row-parallel (``linear_proj``, ``linear_fc2``): A split on its input dimension, B replicated. ``A x`` is partial
  per rank and is summed by ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward);
  B then sees the full low-rank activation and the full output gradient on every rank.
With PP, each stage holds its own layers' adapters (global layer numbers come from the layers themselves).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from megarl.config.schema import LoraConfig
from megarl.models.adapter import local_spec_names
from megarl.models.spec import ModelSpec

COLUMN, ROW = "column", "row"
MODULES = {  # Megatron linear -> (parallel style, its HF targets in fused-output order, HF parent module), in the
    # order a layer registers them (linear_proj before linear_qkv): megarl.planner lays out the adapters' buffer by it
    "self_attention.linear_proj": (ROW, ("o_proj",), "self_attn"),
    "self_attention.linear_qkv": (COLUMN, ("q_proj", "k_proj", "v_proj"), "self_attn"),
    "mlp.linear_fc1": (COLUMN, ("gate_proj", "up_proj"), "mlp"),
    "mlp.linear_fc2": (ROW, ("down_proj",), "mlp"),
}
PARENT = {t: parent for _, targets, parent in MODULES.values() for t in targets}
STYLE = {t: style for style, targets, _ in MODULES.values() for t in targets}
QKV = MODULES["self_attention.linear_qkv"][1]


def hf_shape(spec: ModelSpec, target: str) -> tuple[int, int]:
    """(out_features, in_features) of the HF linear ``target``."""
    h, d = spec.hidden_size, spec.head_dim
    return {
        "q_proj": (spec.num_heads * d, h),
        "k_proj": (spec.num_kv_heads * d, h),
        "v_proj": (spec.num_kv_heads * d, h),
        "o_proj": (h, spec.num_heads * d),
        "gate_proj": (spec.ffn_hidden_size, h),
        "up_proj": (spec.ffn_hidden_size, h),
        "down_proj": (h, spec.ffn_hidden_size),
    }[target]


def peft_key(layer: int, target: str, factor: str) -> str:
    """PEFT's name of a factor ('A' or 'B') in ``adapter_model.safetensors``."""
    return f"base_model.model.model.layers.{layer}.{PARENT[target]}.{target}.lora_{factor}.weight"


@dataclass(frozen=True)
class TPSlice:
    """Where this TP rank's part of a full factor lies."""

    tp_rank: int
    tp: int

    def row_range(self, spec: ModelSpec, target: str) -> tuple[int, int]:
        """[start, stop) of this rank's rows of a column-parallel target's B (the rows of its fused-output block)."""
        out_f = hf_shape(spec, target)[0]
        if target in QKV:  # whole query groups per rank, in group order
            per_group = (spec.num_heads // spec.num_kv_heads if target == "q_proj" else 1) * spec.head_dim
            groups = spec.num_kv_heads // self.tp
            start = self.tp_rank * groups * per_group
            return start, start + groups * per_group
        per = out_f // self.tp
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def col_range(self, spec: ModelSpec, target: str) -> tuple[int, int]:
        """[start, stop) of this rank's input columns of a row-parallel target's A."""
        per = hf_shape(spec, target)[1] // self.tp
        return self.tp_rank * per, (self.tp_rank + 1) * per

    def rows(self, spec: ModelSpec, target: str, B: torch.Tensor) -> torch.Tensor:
        start, stop = self.row_range(spec, target)
        return B[start:stop]

    def cols(self, spec: ModelSpec, target: str, A: torch.Tensor) -> torch.Tensor:
        start, stop = self.col_range(spec, target)
        return A[:, start:stop]


def fresh_factors(spec: ModelSpec, target: str, rank: int, layer: int, seed: int) -> dict[str, torch.Tensor]:
    """PEFT's default initialisation, identical on every rank and layout: A ~ Kaiming-uniform(a=sqrt(5)), i.e.
    U(-1/sqrt(in), 1/sqrt(in)), from a generator seeded by (seed, layer, target); B = 0."""
    out_f, in_f = hf_shape(spec, target)
    digest = hashlib.sha256(f"{seed}/{layer}/{target}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))
    bound = 1.0 / math.sqrt(in_f)
    A = (torch.rand(rank, in_f, generator=gen, dtype=torch.float64) * 2 - 1) * bound
    return {"A": A.float(), "B": torch.zeros(out_f, rank)}


class LinearAdapters(nn.Module):
    """The adapters of one Megatron linear (this TP rank's parts): ``A[target]`` and ``B[target]``."""

    def __init__(self, style: str, targets: tuple[str, ...], factors: dict[str, dict], scaling: float, spec, tp: int):
        super().__init__()
        self.style, self.targets, self.scaling = style, targets, scaling
        self.A = nn.ParameterDict({t: nn.Parameter(f["A"]) for t, f in factors.items()})
        self.B = nn.ParameterDict({t: nn.Parameter(f["B"]) for t, f in factors.items()})
        self.enabled = True
        self.tp = tp
        self.groups = spec.num_kv_heads // tp  # query groups per TP rank (linear_qkv's output blocks)
        self.block = {t: hf_shape(spec, t)[0] // (spec.num_kv_heads if t in QKV else 1) for t in targets}
        self.out_local = {t: self._out_local(spec, t, tp) for t in targets}
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for t in factors:  # the split factor carries Megatron's TP attributes (grad norm counts it on every rank)
            if style == COLUMN:
                set_tensor_model_parallel_attributes(self.B[t], True, 0, 1)
            else:
                set_tensor_model_parallel_attributes(self.A[t], True, 1, 1)

    def _out_local(self, spec, target, tp) -> int:
        out_f = hf_shape(spec, target)[0]
        return out_f // tp if self.style == COLUMN else out_f

    def delta(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """scaling * B (A x) in the layout of this rank's output (zeros in untargeted blocks)."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        def across_ranks(mapping, u):  # one rank: the mapping's all-reduce is skipped, so is its autograd function
            return mapping(u) if self.tp > 1 else u

        if self.style == ROW:
            (t,) = self.A.keys()
            u = across_ranks(reduce_from_tensor_model_parallel_region, nn.functional.linear(x_SBH, self.A[t]))
            return self.scaling * nn.functional.linear(u, self.B[t])
        ys = {}
        for t in self.A:
            u = across_ranks(copy_to_tensor_model_parallel_region, nn.functional.linear(x_SBH, self.A[t]))
            ys[t] = nn.functional.linear(u, self.B[t])
        return self.scaling * self.fuse(ys, x_SBH)

    def fuse(self, ys: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Per-target outputs [..., out_t] of a column-parallel linear as this rank's fused output [..., out_local]
        (zeros in untargeted blocks): linear_qkv per query group [q heads; k; v], linear_fc1 [gate; up]."""
        lead = like.shape[:-1]
        parts = [ys[t] if t in ys else like.new_zeros(*lead, self.out_local[t]) for t in self.targets]
        if self.targets == QKV:
            parts = [p.reshape(*lead, self.groups, self.block[t]) for p, t in zip(parts, self.targets)]
            return torch.cat(parts, dim=-1).reshape(*lead, -1)
        return torch.cat(parts, dim=-1)


def _add_delta(module, args, output):
    out, bias, x = linear_io(module, args, output)
    adapters = module.lora
    if adapters.enabled:
        out = out + adapters.delta(x.float()).to(out.dtype)  # computed in the adapters' fp32
    return out, bias


def fuses_norm(module) -> bool:
    """Transformer Engine's norm + linear (``TELayerNormColumnParallelLinear``: ``linear_qkv`` and ``linear_fc1`` under
    TE's layer spec): its input is the un-normalised residual stream, its ``layer_norm_weight`` the norm's."""
    return hasattr(module, "layer_norm_weight")


def linear_io(module, args, output) -> tuple:
    """(output, bias, the adapters' input) of one forward of an adapted linear. The adapters see what the linear
    multiplies, as vLLM's do: a plain linear's input, or for a fused norm + linear the normalised input, which TE
    returns beside the output once ``return_layernorm_output`` is set (``apply_lora`` sets it): Megatron's wrapper then
    gives ``((out, normed), None)``, or ``(out, bias, normed)`` when TE returns the bias itself."""
    if not getattr(module, "return_layernorm_output", False):
        out, bias = output
        return out, bias, args[0]
    if len(output) == 3:
        return output
    (out, normed), bias = output
    return out, bias, normed


def lora_layers(chunk) -> list[tuple[int, str, nn.Module]]:
    """(global layer index, Megatron linear path, the linear) of every targetable linear of this chunk. A
    routed-expert layer has no MLP linears to target (``megarl.config.validate`` refuses MLP targets on an MoE
    model): its attention linears only."""
    out = []
    for layer in chunk.decoder.layers:
        for path in MODULES:
            module = layer
            for part in path.split("."):
                module = getattr(module, part, None)
            if module is not None:
                out.append((layer.layer_number - 1, path, module))
    return out


def apply_lora(chunk, spec: ModelSpec, lora: LoraConfig, tp_rank: int, tp: int, *, full: dict | None, seed: int):
    """Freeze every base weight of ``chunk`` and hook adapters onto its targeted linears. ``full``: PEFT-named full
    factors (``init_from``); None: fresh ones (``fresh_factors``). Returns the number of adapter parameters here."""
    for p in chunk.parameters():
        p.requires_grad_(False)
    if getattr(chunk, "pre_process", False):  # the first stage: with the embedding frozen its output needs no grad,
        # and activation recompute (a checkpointed layer whose inputs need no grad) would then cut every adapter off
        chunk.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    where = TPSlice(tp_rank, tp)
    count = 0
    for layer, path, module in lora_layers(chunk):
        style, targets, _ = MODULES[path]
        factors = {}
        for t in targets:
            if t not in lora.target_modules:
                continue
            f = (
                {"A": full[peft_key(layer, t, "A")], "B": full[peft_key(layer, t, "B")]}
                if full is not None
                else fresh_factors(spec, t, lora.rank, layer, seed)
            )
            A, B = (f["A"], where.rows(spec, t, f["B"])) if style == COLUMN else (where.cols(spec, t, f["A"]), f["B"])
            device = module.weight.device  # fp32 in every model dtype, beside the base weight
            factors[t] = {k: x.to(device, torch.float32).clone().contiguous() for k, x in (("A", A), ("B", B))}
        if not factors:
            continue
        module.lora = LinearAdapters(style, targets, factors, lora.scaling, spec, tp)
        if fuses_norm(module):  # the normalised input comes back with the output (whole sequence under SP)
            module.return_layernorm_output = True
            module.return_layernorm_output_gathered = True
        module.register_forward_hook(_add_delta)
        count += sum(p.numel() for p in module.lora.parameters())
    return count


def adapter_modules(model) -> list[LinearAdapters]:
    return [m for m in model.modules() if isinstance(m, LinearAdapters)]


def has_lora(model) -> bool:
    return bool(adapter_modules(model))


@contextlib.contextmanager
def adapters_off(model):
    """The base model: every adapter of ``model`` skipped inside the block (the reference policy with LoRA)."""
    mods = adapter_modules(model)
    for m in mods:
        m.enabled = False
    try:
        yield model
    finally:
        for m in mods:
            m.enabled = True


def local_factors(chunk) -> dict[tuple[int, str, str], torch.Tensor]:
    """(global layer, HF target, 'A' | 'B') -> this rank's part of each factor (detached)."""
    out = {}
    for layer, _, module in lora_layers(chunk):
        if hasattr(module, "lora"):
            for t in module.lora.A:
                out[(layer, t, "A")] = module.lora.A[t].detach()
                out[(layer, t, "B")] = module.lora.B[t].detach()
    return out


def merge_tp(spec: ModelSpec, target: str, factor: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full factor from TP ranks 0..tp-1's parts (inverse of ``TPSlice``)."""
    style = STYLE[target]
    if (style == COLUMN and factor == "A") or (style == ROW and factor == "B") or len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=0 if style == COLUMN else 1)


def merged_delta(module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """scaling * B A of one adapted linear, in the layout of this rank's weight shard (no communication: a
    column-parallel shard's rows need only this rank's B rows and the whole A; a row-parallel shard's columns need
    the whole B and this rank's A columns). ``dtype``: compute in it (default: the factors')."""
    lora = module.lora
    dtype = dtype or module.weight.dtype
    products = {t: lora.B[t].to(dtype) @ lora.A[t].to(dtype) for t in lora.A}  # [out_t, in] each
    if lora.style == ROW:
        (delta,) = products.values()
        return lora.scaling * delta
    columns = {t: d.t() for t, d in products.items()}  # [in, out_t]: the fused rows are the fused outputs' blocks
    return lora.scaling * lora.fuse(columns, module.weight.new_empty(module.weight.shape[1], 0, dtype=dtype)).t()


class MergedWeights(Mapping):
    """The actor's parameters by Megatron local name as the rollout engine needs them: an adapted linear's weight is
    W + scaling * B A, computed when read (one at a time, the last one kept), never written into the frozen W;
    the adapter factors themselves are left out."""

    def __init__(self, named: dict[str, torch.Tensor], adapted: dict[str, nn.Module]):
        self._named, self._adapted, self._last = named, adapted, (None, None)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._adapted:
            return self._named[name]
        if self._last[0] != name:
            module = self._adapted[name]
            with torch.no_grad():  # in fp32, rounded once: a bf16 W would swallow a small B A step by step
                w = module.weight
                self._last = (name, (w.float() + merged_delta(module, torch.float32)).to(w.dtype))
        return self._last[1]

    def __iter__(self):
        return (n for n in self._named if ".lora." not in n)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def merged_weights(chunk) -> MergedWeights:
    """``MergedWeights`` of a LoRA chunk (its named parameters, adapted linears merged on read)."""
    named = local_spec_names((n, p.detach()) for n, p in chunk.named_parameters())
    adapted = {}
    for name, module in chunk.named_modules():
        if hasattr(module, "lora") and isinstance(module.lora, LinearAdapters):
            adapted[f"{name}.weight"] = module
    return MergedWeights(named, adapted)
