"""Workarounds for megatron-core bugs that are not CPU-specific: always on, each gated by the versions it applies to.

- ``restore_tp_attributes`` (megatron-core 0.16.x): ``ColumnParallelLinear``, ``RowParallelLinear`` and
  ``VocabParallelEmbedding`` set their weights' ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``
  only inside the random-init helpers, which are skipped when ``perform_initialization=False`` (a model about to be
  loaded). Without the attribute, ``param_is_not_tensor_parallel_duplicate`` treats every TP rank > 0's shard as a
  replica, so the optimizer's gradient norm (and clipping by it) counts only TP rank 0's shards. Seen as a TP=2
  ``actor/grad_norm`` 26% below the single-rank value (tests/test_rl_update.py).
- ``router_without_transformer_engine`` (megatron-core 0.16.x): without Transformer Engine, ``moe_utils`` never
  defines ``te_general_gemm`` (its import sits in a ``try``), yet ``RouterGatingLinearFunction.forward`` tests it
  for None: every MoE router forward raises ``NameError``. Defined as None, the router takes its torch path.
- ``experts_in_their_own_buffer``: Megatron marks routed experts' weights ``allreduce=False`` only when EP > 1, so
  at EP = 1 they share the dense DDP buffer and the one optimizer, at EP > 1 they get a buffer and an optimizer of
  their own (a ``ChainedOptimizer``): a distributed-optimizer checkpoint names its states ``optimizer.*`` in one and
  ``chained_{0,1}.optimizer.*`` in the other and does not load across (``KeyError``). Marked at every EP, the
  layout is the same; at EP = 1 the expert-data-parallel group is the DP group, so the gradients are the same.
- ``prime_optimizer_state`` / ``unshare_optimizer_steps`` (and a patched ``_set_main_param_and_optimizer_states``):
  the distributed optimizer's checkpoint load with torch's Adam (no TE/Apex) in 0.16.x; see below.
"""

from __future__ import annotations

import torch

AFFECTED_VERSIONS = ("0.16.",)


def _applies() -> bool:
    import megatron.core

    return megatron.core.__version__.startswith(AFFECTED_VERSIONS)


def restore_tp_attributes(model) -> int:
    """Give every TP-split weight of ``model`` the attributes random init would have set; returns how many."""
    if not _applies():
        return 0
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    split_dim = {ColumnParallelLinear: 0, VocabParallelEmbedding: 0, RowParallelLinear: 1}
    fixed = 0
    for module in model.modules():
        dim = next((d for cls, d in split_dim.items() if isinstance(module, cls)), None)
        weight = getattr(module, "weight", None)
        if dim is None or weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=getattr(module, "stride", 1))
        fixed += 1
    return fixed


def router_without_transformer_engine() -> None:
    """Define megatron-core's missing ``moe_utils.te_general_gemm`` as None when Transformer Engine is absent."""
    if not _applies():
        return
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def experts_in_their_own_buffer(model) -> int:
    """Mark every routed expert's parameter ``allreduce=False`` (at any EP); returns how many."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    marked = 0
    for module in model.modules():
        if isinstance(module, SequentialMLP):
            for p in module.parameters():
                p.allreduce = False
                marked += 1
    return marked


# --- Distributed optimizer checkpoints with torch.optim.Adam (no TE / Apex), megatron-core 0.16.x -------------------
# Measured in ../shared/facts/megatron-dist-ckpt-cpu.md §2 and shown by tests/test_checkpoint.py:
# (a) a never-stepped optimizer cannot build its loading template: ``sharded_state_dict(is_loading=True)`` calls
#     ``state_dict()``, which asserts that the inner state holds exactly one ``step`` (it holds none);
# (b) ``_set_main_param_and_optimizer_states`` copies every key of the inner state, ``step`` included:
#     fully_reshardable raises ``KeyError: 'step'``, dp_reshardable silently restores the template's step 0 (and
#     copies into leaf views outside ``no_grad``);
# (c) ``load_state_dict`` gives every parameter the *same* ``step`` tensor, which torch Adam then increments once per
#     parameter, so the bias correction after a resume is wrong.


def _torch_adam_distributed(optimizer) -> list:
    """The DistributedOptimizers inside ``optimizer`` (a Megatron optimizer or ChainedOptimizer) whose inner
    optimizer is torch's Adam, when the installed megatron-core has the bugs above."""
    if not _applies():
        return []
    from megatron.core.optimizer import distrib_optimizer as do

    if do.HAVE_APEX_OR_TE:
        return []
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in parts if isinstance(o, do.DistributedOptimizer) and isinstance(o.optimizer, torch.optim.Adam)]


def prime_optimizer_state(optimizer) -> None:
    """(a): give a never-stepped distributed Adam a zero state (step 0, zero moments) so its loading template can
    be built. The load then overwrites all of it."""
    for opt in _torch_adam_distributed(optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                if not opt.optimizer.state[p]:
                    opt.optimizer.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }


def unshare_optimizer_steps(optimizer) -> None:
    """(c): after a load, give every parameter its own ``step`` tensor."""
    for opt in _torch_adam_distributed(optimizer):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def fix_parameter_state_load(optimizer) -> None:
    """(b): make the distributed optimizer's parameter-state load copy the main parameter and the moments only (the
    ``step`` comes from the loaded param groups), under ``no_grad``. Patches the class once, on first use."""
    for opt in _torch_adam_distributed(optimizer):
        _patch_set_main_param(type(opt))


def _patch_set_main_param(cls) -> None:
    if getattr(cls._set_main_param_and_optimizer_states, "_megarl_fixed", False):
        return
    original = cls._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        with torch.no_grad():
            main_param.copy_(tensors["param"])
            for key, value in self.optimizer.state[main_param].items():
                if key != "step":
                    value.copy_(tensors[key])

    _set_main_param_and_optimizer_states._megarl_fixed = True
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
