"""Megatron-core's import-time warnings that Transformer Engine and Apex are not installed: silenced by message and
module (``install``, run by ``import megarl``), and said once in megarl's own start-up line instead
(``implementations``). The fallbacks they announce (torch optimizers, local multi-tensor kernels) are what megarl
expects on CPU and on GPU hosts without Apex, and nothing a user could act on; every other warning still shows."""

from __future__ import annotations

import sys
import warnings

FALLBACK_MESSAGE = r"Transformer Engine and Apex are not installed\. Falling back to "
"""The start of each of the four warnings (megatron-core 0.16.1: ``optimizer/__init__.py:24``,
``optimizer/optimizer.py:28``, ``optimizer/clip_grads.py:29``, ``megatron_fsdp/mixed_precision.py:114``)."""
FALLBACK_MODULES = r"megatron\.core\.(optimizer|distributed\.fsdp)"
"""The modules that issue them."""


def install() -> None:
    """Silence exactly the fallback warnings, in this process (every process that imports megarl)."""
    warnings.filterwarnings("ignore", message=FALLBACK_MESSAGE, category=UserWarning, module=FALLBACK_MODULES)


def implementations(transformer_impl: str) -> str:
    """What this process runs (after megatron-core's optimizer was imported): the layers' implementation and the
    optimizer's, e.g. 'layers: megatron-core local spec (torch); optimizer: torch AdamW, local multi-tensor ops
    (Transformer Engine and Apex are not installed)'."""
    layers = "Transformer Engine" if transformer_impl == "transformer_engine" else "megatron-core local spec (torch)"
    optim = sys.modules.get("megatron.core.optimizer")
    adam = getattr(optim, "Adam", None)
    source = (getattr(adam, "__module__", "") or "").split(".")[0]
    names = {"torch": "torch AdamW, local multi-tensor ops", "transformer_engine": "Transformer Engine FusedAdam",
             "apex": "Apex FusedAdam"}  # fmt: skip
    line = f"layers: {layers}; optimizer: {names.get(source, 'not loaded')}"
    return line + (" (Transformer Engine and Apex are not installed)" if source == "torch" else "")
