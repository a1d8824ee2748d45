"""Transports: how one layer of destination tensors, filled by the executor, enters a vLLM engine in this process.

A transport names the destination layout the plan must fill (``destination``) and consumes the per-layer stream of
filled tensors (``load``). The engine is colocated: it lives in this process (vLLM's ``external_launcher``), so the
tensors are handed over in memory. vLLM is imported lazily; nothing here runs without an engine.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator

import torch

from megarl.config.validate import FULL_RELOAD_PADDED_EXPERTS, full_reload_pads_experts
from megarl.lora.peft_io import WEIGHTS_FILE, write_peft_adapter
from megarl.models.spec import ModelSpec
from megarl.reshard.executor import ReshardVerificationError, comm_device
from megarl.reshard.layout import SideLayout, hf_layout, peft_adapter_layout, vllm_layout


def destination_layout(
    transport: str, spec: ModelSpec, tp: int, world_size: int, gpus_per_node: int, lora=None
) -> SideLayout:
    """What ``transport`` fills on engine ranks 0..world_size-1 (engines of ``tp`` ranks). It needs no engine, so
    ranks that only send (the actor's pool, when the engines have their own) plan the same sync."""
    if transport == "shard_write":  # each rank its own vLLM TP shard
        return vllm_layout(spec, tp, world_size, gpus_per_node)
    if transport == "full_reload":  # every full HF tensor on every rank
        return hf_layout(spec, list(range(world_size)), gpus_per_node)
    if transport == "lora_slots":  # every full adapter factor (PEFT names) on every rank
        return peft_adapter_layout(spec, lora, list(range(world_size)), gpus_per_node)
    raise ValueError(f"unknown transport {transport!r}")


def vllm_model(llm) -> torch.nn.Module:
    """The engine's model object (in-process worker; ``apply_model`` calls the function directly)."""
    return llm.apply_model(lambda model: model)[0]


def _holders(model: torch.nn.Module) -> dict[str, list[tuple[torch.nn.Module, str]]]:
    """Every (module, attribute) that holds each named parameter: a tied lm_head shares embed_tokens' Parameter."""
    by_id: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                by_id.setdefault(id(param), []).append((module, attr))
    return {_base_name(name): by_id[id(p)] for name, p in model.named_parameters()}


def _base_name(name: str) -> str:
    """The checkpoint name of an engine parameter: an engine with LoRA wraps its linears (and the embedding), which
    puts their own parameters under ``base_layer`` (vllm/lora/layers/base_linear.py)."""
    return name.replace(".base_layer.", ".")


def _post_load(modules, platform_needs_it: bool) -> None:
    """Re-run vLLM's post-load step (CPU: oneDNN packing) for these modules; norms have none. A fused-MoE method
    run again for a weight update keeps its kernel and skips its experts' own step
    (``fused_moe/unquantized_fused_moe_method.py:187-205``), which on CPU pads the intermediate size to a multiple
    of 32 and prepacks both weights (``fused_moe/experts/cpu_moe.py:208-235``): that step is run here."""
    if platform_needs_it:
        for module in modules:
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
                _prepack_experts(module)


def _prepack_experts(module: torch.nn.Module) -> None:
    """The fused experts' own post-load step, when ``module`` holds fused experts."""
    kernel = getattr(module.quant_method, "moe_kernel", None)
    if kernel is not None:
        kernel.fused_experts.process_weights_after_loading(module)


def _platform_packs_weights() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class ShardWrite:
    """Data path: executor -> this rank's vLLM-layout shards (one layer staged) -> the engine's modules.

    Each rank receives only its own vLLM TP shard (fewest bytes). Per layer, every parameter is written into the
    module that owns it: a plain copy when the engine keeps the tensor in that shape (CUDA, unquantized: nothing else
    is needed), otherwise the module's weight is replaced and vLLM's own post-load step
    (``quant_method.process_weights_after_loading``) is re-run for the modules written. That is what the CPU build
    needs: it packs linear weights into oneDNN handles and leaves ``weight`` empty, and the LM head matmul uses a
    packed copy of the embedding (tied or not). Quantized models need the full-reload transport.
    """

    name = "shard_write"

    def __init__(self, llm, spec: ModelSpec, tp: int, dtype: torch.dtype):
        import torch.distributed as dist

        self.spec, self.tp, self.dtype = spec, tp, dtype
        self.repack = _platform_packs_weights()
        self.holders = _holders(vllm_model(llm))
        # a parameter the layout does not describe would never be written: stale data (after sleep: garbage)
        shards = self.destination(dist.get_world_size(), 1).ranks[dist.get_rank()]
        described = {s.name for s in shards}
        self.views = {s.name: s.view for s in shards if s.view}
        """The fused experts' own shapes (the executor fills their 2-D row views)."""
        if described != set(self.holders):
            raise RuntimeError(
                "vLLM's parameters and megarl's vLLM layout disagree: engine-only "
                f"{sorted(set(self.holders) - described)}, layout-only {sorted(described - set(self.holders))}"
            )

    def destination(self, world_size: int, gpus_per_node: int) -> SideLayout:
        return destination_layout(self.name, self.spec, self.tp, world_size, gpus_per_node)

    @torch.no_grad()
    def load(self, layers: Iterable[dict[str, torch.Tensor]]) -> None:
        for tensors in layers:
            touched: dict[int, torch.nn.Module] = {}
            experts: dict[int, torch.nn.Module] = {}  # the modules holding fused experts
            for name, value in tensors.items():  # names come from the layout, checked against the engine above
                value = value.view(self.views[name]) if name in self.views else value
                for module, attr in self.holders[name]:
                    current = getattr(module, attr)
                    if current.shape == value.shape and not (self.repack and name in self.views):
                        current.data.copy_(value)
                    elif self.repack:  # packed away by the CPU post-load step (the experts: prepacked in their own
                        # shape, or padded): give the module its weight to re-pack
                        setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))
                    else:  # on CUDA a new Parameter would leave vLLM's memory pool and captured graphs
                        raise RuntimeError(
                            f"{name}: engine holds shape {tuple(current.shape)}, sync sent {value.shape}"
                        )
                    touched[id(module)] = module
                    if name in self.views:
                        experts[id(module)] = module
            _post_load(touched.values(), self.repack)
            if not self.repack:  # CUDA: the experts' method converts what was copied in again (FlashInfer CUTLASS
                # swaps w13 to [up; gate], ROCm's AITER shuffles: fused_moe/oracle/unquantized.py), copying into the
                # same storage on a weight update (unquantized_fused_moe_method.py:180-189): captured graphs stay valid
                for module in experts.values():
                    module.quant_method.process_weights_after_loading(module)


class FullReload:
    """Data path: executor -> full HF-named tensors of one layer on every rank -> vLLM ``reload_weights``.

    vLLM's layerwise reload buffers each layer until it is complete, then slices, loads and post-processes it with its
    own checkpoint loaders: the portable path (any platform, quantized models too). Each rank receives every full
    tensor, so it moves more bytes than a shard write; the layer buffered inside vLLM is outside the executor's budget.

    Tied embeddings: the checkpoint has no lm_head, so vLLM's reload never re-processes the lm_head module; on CPU its
    packed copy of the (shared) embedding would stay stale (measured: logprobs off by 4.3). Modules that share a
    parameter with another module are therefore post-processed again after the reload.
    """

    name = "full_reload"

    def __init__(self, llm, spec: ModelSpec, tp: int, dtype: torch.dtype):
        self.llm, self.spec, self.dtype = llm, spec, dtype
        self.repack = _platform_packs_weights()
        self.refusal = FULL_RELOAD_PADDED_EXPERTS if self.repack and full_reload_pads_experts(spec, tp) else None
        model = vllm_model(llm)
        self.shared = [m for holders in _holders(model).values() if len(holders) > 1 for m, _ in holders]
        self.experts = [m for m in model.modules() if getattr(getattr(m, "quant_method", None), "moe_kernel", None)]
        """Fused experts: vLLM's reload re-runs their method, which skips their own (CPU: prepacking) step."""

    def destination(self, world_size: int, gpus_per_node: int) -> SideLayout:
        return destination_layout(self.name, self.spec, 1, world_size, gpus_per_node)

    def load(self, layers: Iterable[dict[str, torch.Tensor]]) -> None:
        if self.refusal:  # before any layer is read: every engine rank raises alike, the engine is unchanged
            raise ValueError(f"full_reload: {self.refusal}; use the shard_write transport")

        def named() -> Iterator[tuple[str, torch.Tensor]]:
            for tensors in layers:
                yield from tensors.items()

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named()})
        with torch.no_grad():
            _post_load(self.shared, self.repack)
            for module in self.experts if self.repack else ():
                _prepack_experts(module)


TRANSPORTS = {t.name: t for t in (ShardWrite, FullReload)}
"""The transports of the base weights (every sync without LoRA slots; the first one with them)."""


class AdapterSlots:
    """Data path: executor -> every full adapter factor (PEFT names) on every rank -> a PEFT adapter directory in
    this run's RAM-backed shared memory -> vLLM's LoRA manager (``add_lora``) under a new adapter id; the previous
    adapter and its directory are removed. ``request`` is what every generation must carry.

    vLLM has no in-memory adapter load: its worker reads ``adapter_model.safetensors`` from the request's path and
    slices the full factors for its own TP rank (vllm/lora/worker_manager.py), hence full factors on every rank.
    What was written is read back and compared with what the executor verified before vLLM reads it. The whole
    adapter is staged at once (``megarl plan``: "adapter bytes"; 8-80 MiB for a 7B model)."""

    name = "lora_slots"

    def __init__(self, llm, spec: ModelSpec, lora, dtype: torch.dtype, directory: str):
        self.llm, self.spec, self.lora, self.dtype, self.directory = llm, spec, lora, dtype, directory
        self.request = None
        self._ids = 0

    def destination(self, world_size: int, gpus_per_node: int) -> SideLayout:
        return destination_layout(self.name, self.spec, 1, world_size, gpus_per_node, self.lora)

    def load(self, layers: Iterable[dict[str, torch.Tensor]]) -> None:
        """Collective over the world (every rank loads its engine's copy): all ranks succeed, or all raise with the
        old adapter removed, and no directory is left behind."""
        import torch.distributed as dist

        tensors = {name: t.cpu() for layer in layers for name, t in layer.items()}
        self.remove()
        self._ids += 1  # the same on every rank: every rank gets here, whatever happens below
        path = os.path.join(self.directory, f"adapter-{self._ids}")
        error = None
        try:
            self.request = self._add(path, tensors)
        except Exception as e:  # noqa: BLE001 -- agreed on below, then raised on every rank
            error = e
            shutil.rmtree(path, ignore_errors=True)
        failed = torch.tensor([float(error is not None)], device=comm_device())
        dist.all_reduce(failed)
        if failed.item():
            self.remove()  # a rank that did load it drops it again: one adapter everywhere, or none
            raise error or RuntimeError("another rank could not load its copy of the adapter (its error is in its log)")

    def _add(self, path: str, tensors: dict[str, torch.Tensor]):
        from safetensors.torch import load_file
        from vllm.lora.request import LoRARequest

        write_peft_adapter(path, tensors, self.lora)
        written = load_file(os.path.join(path, WEIGHTS_FILE))
        bad = sorted(k for k, t in tensors.items() if k not in written or not torch.equal(written[k], t))
        if bad or len(written) != len(tensors):
            raise ReshardVerificationError(f"the adapter written to {path} differs from the one received: {bad[:3]}")
        request = LoRARequest(f"megarl-{self._ids}", self._ids, path)
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter {path}")
        return request

    def remove(self) -> None:
        """Take the current adapter out of the engine and its directory off shared memory."""
        if self.request is not None:
            self.llm.llm_engine.remove_lora(self.request.lora_int_id)
            shutil.rmtree(self.request.lora_path, ignore_errors=True)
            self.request = None
