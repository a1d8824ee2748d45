"""CPU compatibility shim: lets megatron-core 0.16.1 run on a CPU-only torch over gloo.

Applied only when CUDA is absent (``install_if_needed``); on a GPU host nothing here runs.
What it patches, and why (each item was hit by megatron-core 0.16.1 on CPU):

Process-wide (module attributes, so they hold in every thread):
  * ``torch.cuda.current_device`` -> ``torch.device("cpu")``: ~70 call sites pass it as ``device=``.
  * ``torch.cuda.synchronize`` / ``empty_cache`` / ``set_device`` -> no-ops.
  * ``torch.cuda.device_count`` -> 1: the persistent async checkpoint worker computes ``rank % device_count()``.
  * ``torch.cuda.{get,set}_rng_state``, ``manual_seed``, ``manual_seed_all`` (and ``torch.cuda.random.*``) -> the CPU
    default generator. ``manual_seed`` must call ``torch.default_generator.manual_seed``; ``torch.manual_seed`` would
    call back into ``torch.cuda.manual_seed_all`` and recurse.
  * ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` -> a host stream whose events are complete: the MoE
    all-to-all dispatcher builds a side stream and records an event on it every forward (token_dispatcher.py).
  * ``token_dispatcher.maybe_move_tensor_to_cpu`` -> also turns a host tensor into numpy when asked
    (``as_numpy=True``): on a GPU the dispatcher's all-to-all split sizes arrive on the host as numpy arrays, on the
    CPU they stayed tensors, which ``all_to_all_single`` refuses under expert parallelism (``TypeError``).
  * megatron's activation-recompute backward (``CheckpointFunction.backward``) runs in the scoped mode below (autograd
    runs backward functions outside any mode entered around ``backward()``).
  * ``fused_softmax.get_{default,sliding_window}_causal_mask`` (the unfused attention's, ``device="cuda"``) run in
    the scoped mode wherever they are called.
  * ``megatron.core.tensor_parallel.random._{get,set}_cuda_rng_state`` -> CPU generator state, so the model-parallel
    RNG tracker (``fork()``) works.
  * ``torch.cuda.is_available`` is deliberately NOT stubbed: vLLM and HF must keep seeing a CPU machine.

Scoped (``megatron_mode()``, a thread-local ``TorchFunctionMode``):
  * ``device="cuda"`` (keyword or positional, str or ``torch.device``) -> cpu; ``Tensor.cuda()`` -> identity;
    ``pin_memory=True`` dropped; ``Tensor.type()`` answers ``'torch.cuda.FloatTensor'``-style names
    (``clip_grads.py``, ``optimizer.py`` and ``distrib_optimizer.py`` assert on them).
  * It is entered only around Megatron entry points: process-wide it costs ~3.3 us per torch call and made vLLM
    generation 1.4x slower (shared/facts/cpu-shim-with-vllm.md). The mode is thread-local, so Megatron work must
    run on the thread that entered it.
  * The model's own forward in a training or log-prob step, and the loss Megatron's schedule calls on its output,
    run outside it (``outside_megatron_mode``, entered by ``megarl.backend.step``), as they run on a GPU: a
    local-spec forward asks for CUDA only in the unfused attention's causal masks
    (``fused_softmax.get_{default,sliding_window}_causal_mask``), which run in the mode wherever they are called;
    megarl's losses ask for none. Measured with ``benchmarks/train_step.py --host`` (the 1.2B's 16 layers at width
    64, where a step is what the host spends issuing it): megarl's step 1.27x the transformers step with the mode
    around the forward, 1.09x without it; 1.03x -> 1.00x with the loss out of it too (~150 torch calls per
    micro-batch, ~1.2 us each in the mode).

Spawned children (vLLM workers, ``run_on_ranks``' ranks) re-import modules but never run ``main``:
``install`` sets ``MEGARL_CPU_SHIM=1`` and ``import megarl`` re-installs the stubs when it sees it.

Placement guard (tests): with ``MEGARL_FAKE_DEVICE=meta`` "the GPU" is the ``meta`` device instead of the CPU:
``current_device()`` and every CUDA request inside the mode answer ``meta``, so a tensor that code left on the CPU
(never moved to the rank's device) stays visibly on the CPU. Nothing can be computed there: it is for building
models and checking where their tensors live.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch.overrides import TorchFunctionMode

ENV_VAR = "MEGARL_CPU_SHIM"
FAKE_DEVICE_VAR = "MEGARL_FAKE_DEVICE"
"""Test mode: the device type that stands in for CUDA (``meta``); unset: the CPU."""
_CPU = torch.device("cpu")
_state = {"installed": False, "device": _CPU}  # set once per process by install(); not a cache


def device() -> torch.device:
    """The device the shim stands in for CUDA with: the CPU, or the fake device of the placement guard."""
    return _state["device"]


def is_installed() -> bool:
    """True once the shim has been installed in this process."""
    return _state["installed"]


def needed() -> bool:
    """The shim is needed exactly when this torch has no usable CUDA device."""
    return not torch.cuda.is_available()


def install_if_needed() -> bool:
    """Install the shim when CUDA is absent. Returns whether it is installed."""
    if needed():
        install()
    return is_installed()


class _HostEvent:
    """A CUDA event on the CPU: already complete."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream on the CPU: work is done when it is issued."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _host_splits(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for host tensors: numpy where the GPU path gives numpy."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _cpu_get_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def install() -> None:
    """Apply the process-wide stubs (idempotent). See the module docstring for the list."""
    if _state["installed"]:
        return
    fake = os.environ.get(FAKE_DEVICE_VAR)
    _state["device"] = target = torch.device(fake) if fake else _CPU
    cuda = torch.cuda
    cuda.current_device = lambda: target
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 1
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = _cpu_manual_seed
    cuda.manual_seed_all = _cpu_manual_seed
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.random.manual_seed = _cpu_manual_seed
    cuda.random.manual_seed_all = _cpu_manual_seed
    # the MoE all-to-all dispatcher moves its split sizes to the host on a side stream (token_dispatcher.py:
    # ``torch.cuda.Stream()`` at construction, ``current_stream``/``stream``/``record_event`` every forward): on the
    # CPU there is one stream and nothing to wait for
    cuda.Stream = _HostStream
    cuda.current_stream = lambda device=None: _HOST_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_splits

    from megatron.core.tensor_parallel import random as mc_random

    mc_random._get_cuda_rng_state = _cpu_get_rng_state
    mc_random._set_cuda_rng_state = _cpu_set_rng_state
    # activation recompute re-runs layers inside autograd's backward, where the mode entered around the step is not
    # active (seen: get_default_causal_mask asking for device="cuda", before it ran in the mode below)
    recompute = mc_random.CheckpointFunction
    recompute.backward = staticmethod(_in_megatron_mode(recompute.backward))
    from megatron.core.fusions import fused_softmax

    for name in ("get_default_causal_mask", "get_sliding_window_causal_mask"):  # the forward's CUDA requests
        setattr(fused_softmax, name, _in_megatron_mode(getattr(fused_softmax, name)))
    os.environ[ENV_VAR] = "1"
    _state["installed"] = True


def _in_megatron_mode(function):
    """``function`` run in the scoped mode wherever it is called (outside ``megatron_mode``'s blocks too)."""

    @functools.wraps(function)
    def in_mode(*args, **kwargs):
        with megatron_mode():
            return function(*args, **kwargs)

    return in_mode


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means a CUDA ordinal


_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placement requests to the shim's device (the CPU; the guard's fake device) for the torch calls
    made inside the mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = _state["device"]
        if func is torch.Tensor.cuda:
            return args[0] if target == _CPU else args[0].to(target)
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            return _TYPE_NAMES.get(args[0].dtype, "torch.cuda.FloatTensor")
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = target
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones):
            args = tuple(target if i > 0 and _is_cuda(a) and not isinstance(a, int) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def megatron_mode():
    """Wrap every Megatron entry point: the CUDA->CPU mode when the shim is installed, else nothing."""
    return CudaToCpuMode() if _state["installed"] else contextlib.nullcontext()


@contextlib.contextmanager
def outside_megatron_mode():
    """Within the block, torch calls skip the scoped mode entered around it (the model's forward: see the module
    docstring); nothing changes where the innermost torch function mode is not the shim's (a GPU, another mode)."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if not isinstance(_get_current_function_mode(), CudaToCpuMode):
        yield
        return
    with _pop_mode_temporarily():
        yield
