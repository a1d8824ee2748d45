"""megarl: RL post-training for LLMs on megatron-core (training) and vLLM (rollout)."""

import os as _os

from megarl.compat import quiet as _quiet

__version__ = "0.1.0"

_quiet.install()  # megatron-core's "Transformer Engine and Apex are not installed" fallbacks, said once by megarl

if _os.environ.get("MEGARL_CPU_SHIM") == "1":
    # A child spawned by megatron or vLLM re-imports modules but never runs our entry point: re-install the shim.
    from megarl.compat import cpu as _cpu

    _cpu.install_if_needed()
