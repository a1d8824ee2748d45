"""What 'auto' means on each device, for the settings whose right value depends on it.

| setting                  | on CUDA                                              | on CPU          |
|--------------------------|------------------------------------------------------|-----------------|
| ``model.dtype``          | bfloat16                                             | float32         |
| ``rollout.enforce_eager``| false (CUDA graphs)                                  | true            |
| ``rollout.kv_cache_mb``  | vLLM sizes it within ``rollout.gpu_memory_utilization`` | 1024 MiB     |
| fp32 matmuls             | TF32 (``torch.set_float32_matmul_precision("high")``) | unchanged      |

An explicit value always wins. The loader resolves ``model.dtype`` and ``rollout.enforce_eager`` for the device it
runs on (``megarl plan`` for CUDA, whatever machine plans); ``rollout.kv_cache_mb`` stays 'auto' on CUDA (vLLM sizes
the cache when it starts; ``RolloutConfig``'s reader is ``kv_cache_bytes``). ``megarl train`` prints the choices.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import os
import sys

AUTO = "auto"
CPU_KV_CACHE_MB = 1024
"""The KV cache on CPU with ``rollout.kv_cache_mb: auto`` (host memory; vLLM-CPU needs an explicit size)."""


LIBCUDA = "libcuda.so.1"
"""The CUDA driver library that ``on_cuda`` asks before torch is loaded."""


def on_cuda() -> bool:
    """Whether this process trains on CUDA: ``torch.cuda.is_available()``. Until something has imported torch (2 s on
    a small CPU box, before any config error could be said) the same question goes to what torch would ask: is torch
    a CUDA build, and does the CUDA driver see a device (``cuDeviceGetCount``, after ``CUDA_VISIBLE_DEVICES``). A ROCm
    build, or ``PYTORCH_NVML_BASED_CUDA_CHECK`` set, is asked through torch itself."""
    torch = sys.modules.get("torch")
    build = None if torch is not None else torch_build()
    if build == "other":
        import torch  # here: a build or a setting the driver question does not cover

    if torch is not None:
        return torch.cuda.is_available()
    return build == "cuda" and driver_devices() > 0


def torch_build() -> str:
    """The installed torch's accelerator build, read from its version file (not imported): 'cpu', 'cuda', or
    'other' (ROCm, or the NVML-based availability check requested, which the driver question does not answer)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "cpu"
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return "other"
    built = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name) and target.id in ("cuda", "hip"):
                    built[target.id] = node.value.value
    if built.get("hip") or (built.get("cuda") and os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"):
        return "other"
    return "cuda" if built.get("cuda") else "cpu"


def driver_devices(library: str | None = None) -> int:
    """The CUDA devices the driver ``library`` (default ``LIBCUDA``) sees; 0 without a driver or a device."""
    try:
        lib = ctypes.CDLL(library or LIBCUDA)
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def resolve(cfg, cuda: bool) -> list[str]:
    """Replace the 'auto' values of ``cfg`` (a MegarlConfig) by ``cuda``'s choices, in place; returns one line per
    choice made (``model.dtype=bfloat16``), nothing for values that were set."""
    chosen = []
    if cfg.model.dtype == AUTO:
        cfg.model.dtype = "bfloat16" if cuda else "float32"
        chosen.append(f"model.dtype={cfg.model.dtype}")
    ro = cfg.rollout
    if ro.enforce_eager == AUTO:
        ro.enforce_eager = enforce_eager(ro, cuda)
        chosen.append(f"rollout.enforce_eager={str(ro.enforce_eager).lower()}")
    if ro.kv_cache_mb == AUTO:
        kv = kv_cache_bytes(ro, cuda)
        if kv is None:  # stays 'auto': vLLM sizes it when it starts
            chosen.append(f"rollout.kv_cache_mb=auto (vLLM sizes it within gpu_memory_utilization="
                          f"{ro.gpu_memory_utilization})")  # fmt: skip
        else:
            ro.kv_cache_mb = kv // 1024**2
            chosen.append(f"rollout.kv_cache_mb={ro.kv_cache_mb}")
    return chosen


def kv_cache_bytes(rollout, cuda: bool) -> int | None:
    """The engine's KV cache in bytes, or None where vLLM sizes it (CUDA with ``kv_cache_mb: auto``)."""
    if rollout.kv_cache_mb != AUTO:
        return rollout.kv_cache_mb * 1024**2
    return None if cuda else CPU_KV_CACHE_MB * 1024**2


def enforce_eager(rollout, cuda: bool) -> bool:
    return (not cuda) if rollout.enforce_eager == AUTO else bool(rollout.enforce_eager)


def apply_tf32(cuda: bool) -> list[str]:
    """On CUDA, fp32 matmuls (an fp32 model, fp32 heads and losses) run on TF32 tensor cores."""
    if not cuda:
        return []
    import torch  # here: only a process that trains on CUDA sets it (the config checks load no torch)

    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    return ["fp32 matmuls on TF32"]
