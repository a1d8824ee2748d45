"""Training state to host memory while vLLM generates, and back before Megatron needs it (colocated GPU jobs).

What moves is a set of tensor *storages*: the DDP gradient buffer (every ``main_grad`` and bucket is a view of it),
the distributed optimizer's parameter buffer, optimizer state, a frozen model's parameters. Offloading copies each
storage to a host buffer (pinned on CUDA at its exact size, ``host_buffer``; kept for the next round) and resizes
the storage to zero bytes, which frees it; reloading grows it back in place and copies the bytes back. Every view
(``param.data``, ``param.main_grad``, the optimizer's references) stays valid, so nothing has to be re-wired, and
the round trip is bitwise.

The groups are named like the planner's consumers (``megarl.planner.memory``), which models exactly these flags.
Adam's ``step`` counters stay put (scalars: on the host with torch's default Adam, on the GPU with its fused one).
"""

from __future__ import annotations

import weakref

import torch

from megarl.config.schema import OffloadConfig

ACTOR_GRADS, ACTOR_OPTIMIZER = "actor grads", "actor optimizer"
CRITIC, REFERENCE = "critic params+grads+optimizer", "reference params"
REWARD_MODEL = "reward model params"
GROUP_FLAGS = {ACTOR_GRADS: "actor_grads", ACTOR_OPTIMIZER: "actor_optimizer", CRITIC: "critic", REFERENCE: "reference",
               REWARD_MODEL: "reward_model"}  # fmt: skip
"""Each group (named as the planner's consumer) and the ``offload.*`` flag that moves it."""


def flagged_groups(flags: OffloadConfig) -> list[str]:
    """The groups the flags move (whether offloading is active at all is ``flags.active``)."""
    return [name for name, flag in GROUP_FLAGS.items() if getattr(flags, flag)]


def grad_buffers(ddp) -> list[torch.Tensor]:
    """The contiguous gradient buffers of a Megatron DDP model."""
    return [b.grad_data for b in (*ddp.buffers, *ddp.expert_parallel_buffers)]


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Optimizer state of a Megatron optimizer (chained or not): Adam moments / momentum, and the fp32 main
    parameters of a bf16/fp16 model (plain or distributed optimizer); not the scalar ``step`` counters."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            out += [v for k, v in state.items() if k != "step" and torch.is_tensor(v)]
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            out += [p for group in getattr(opt, name, []) for p in group]
    return out


def state_groups(models, flags: OffloadConfig) -> dict[str, list[torch.Tensor]]:
    """What the flags move, by planner name (``models``: a trainer RLModels)."""
    on = flagged_groups(flags)
    groups = {}
    if ACTOR_GRADS in on:
        groups[ACTOR_GRADS] = grad_buffers(models.actor)
    if ACTOR_OPTIMIZER in on:
        groups[ACTOR_OPTIMIZER] = optimizer_tensors(models.actor_optim)
    if CRITIC in on and models.critic is not None:
        critic = list(models.critic.parameters()) + grad_buffers(models.critic)
        groups[CRITIC] = critic + optimizer_tensors(models.critic_optim)
    if REFERENCE in on and models.reference is not None:
        groups[REFERENCE] = list(models.reference.parameters())
    if REWARD_MODEL in on and models.reward_model is not None:
        groups[REWARD_MODEL] = list(models.reward_model.parameters())
    return groups


def _whole(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A host buffer of exactly ``nbytes`` (uint8); ``pin``: page-locked, so copies from the GPU run at full speed.

    Not ``torch.empty(..., pin_memory=True)``: PyTorch's caching host allocator rounds every allocation up to a power
    of two (an 8.8 GB gradient buffer pins 16 GB; a 70B rank's ~53 GB of offloaded state could pin ~0.7 TB per
    node). The ordinary allocation is page-locked in place instead (``pin_in_place``)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        pin_in_place(buf)
    return buf


def pin_in_place(buf: torch.Tensor) -> None:
    """Page-lock ``buf``'s memory as it is (``cudaHostRegister``), unlocked again when ``buf`` is freed."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if err != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed: {err}")
    weakref.finalize(buf, cudart.cudaHostUnregister, ptr)


def distinct_storages(tensors) -> list[torch.UntypedStorage]:
    """The non-empty storages behind ``tensors``, each once (views of one buffer share it), in first-seen order."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


class HostCopies:
    """The storages of some tensors, each with a host buffer of its size."""

    def __init__(self, tensors: list[torch.Tensor], previous: HostCopies | None = None, pin: bool = False):
        """``pin``: page-locked host buffers (the state lives on a GPU)."""
        self.storages = distinct_storages(tensors)
        sizes = [s.nbytes() for s in self.storages]
        if previous is not None and [h.numel() for h in previous.host] == sizes:
            self.host = previous.host  # the last round's buffers (pinned allocations are slow)
        else:
            self.host = [host_buffer(n, pin) for n in sizes]

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for h in self.host)

    def offload(self) -> None:
        for s, h in zip(self.storages, self.host):
            h.copy_(_whole(s))  # blocking: the device storage is freed right after
            s.resize_(0)

    def reload(self) -> None:
        for s, h in zip(self.storages, self.host):
            s.resize_(h.numel())
            _whole(s).copy_(h)


class Offloader:
    """Moves the flagged training state out (``offload``) and back (``reload``); a no-op when disabled."""

    def __init__(self, models, flags: OffloadConfig, on_gpu: bool):
        """``on_gpu``: the state lives on GPUs (offloading is on with ``offload.enable: auto``; host copies pinned)."""
        self.models, self.flags, self.pin = models, flags, on_gpu
        self.enabled = flags.active(on_gpu)
        self.moved: dict[str, HostCopies] = {}
        self._last: dict[str, HostCopies] = {}

    def offload(self) -> dict[str, int]:
        """Free the flagged state on the device; returns the bytes freed per group (empty if already out)."""
        if not self.enabled or self.moved:
            return {}
        claimed: set[int] = set()
        for name, tensors in state_groups(self.models, self.flags).items():
            fresh = [t for t in tensors if t.untyped_storage().data_ptr() not in claimed]
            claimed |= {t.untyped_storage().data_ptr() for t in fresh}
            self.moved[name] = HostCopies(fresh, self._last.get(name), pin=self.pin)
        for copies in self.moved.values():
            copies.offload()
        return {name: copies.nbytes for name, copies in self.moved.items()}

    def reload(self) -> None:
        for copies in self.moved.values():
            copies.reload()
        self._last, self.moved = self.moved, {}
