"""The only package that patches torch, megatron-core or vLLM. Its modules are imported by name (this file imports
none: a config check that needs one of them loads no torch).

- ``cpu``: the CPU shim for megatron-core (installed only when CUDA is absent; see its docstring).
- ``megatron_fixes``: workarounds for megatron-core bugs on every platform, gated by version.
- ``megatron_speed``: what megatron-core's local path (no apex, no TE) does slowly, results unchanged (bitwise or
  within rounding): the logits' transpose, RoPE as one function, RMSNorm's CPU backward and the TP mappings at one
  rank (installed by ``megarl.models.builder``), the prompt positions' logits, gradient clipping, weight gradients
  into ``main_grad``, torch's fused Adam on CPU (``megarl.backend.setup``).
- ``dm_math``: DeepMind's mathematics_dataset 1.0.1 under sympy 1.14 (a moved import), and its global RNGs kept.
- ``host_memory``: freed host memory kept in a CPU rank for reuse (glibc mallopt; installed by the trainer).
- ``checkpoint_writer``: megatron's checkpoint writer in threads of the rank, not forked processes joined by
  multiprocessing queues (named semaphores a SIGKILL can leave in /dev/shm); installed by ``megarl.checkpoint``.
- ``vllm_shm``: vLLM's shared-memory names carry the run's identity (installed by the vLLM engine).
"""
