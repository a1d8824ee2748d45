"""Wrap a model chunk for training: Megatron DDP (grad buffers, DP all-reduce) and the Megatron optimizer."""

from __future__ import annotations

import torch

from megarl.compat.cpu import megatron_mode
from megarl.compat.megatron_speed import fused_adam, multi_tensor_fallbacks_in_place, weight_gradients_into_main_grad
from megarl.config.schema import OptimConfig


def wrap_for_training(model_chunk, optim: OptimConfig):
    """Return (ddp_model, optimizer) for one model chunk, wired so Megatron's schedules finalize gradients."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tf_config = model_chunk.config
    multi_tensor_fallbacks_in_place()
    # mixed precision (fp32 main parameters) for half-precision trainable parameters; a LoRA actor trains only its
    # fp32 adapters (its frozen base may be bf16): a plain fp32 optimizer (Megatron's mixed one cannot checkpoint
    # fp32 parameters beside half ones)
    half = any(p.requires_grad and p.dtype in (torch.bfloat16, torch.float16) for p in model_chunk.parameters())
    with megatron_mode():
        ddp = DistributedDataParallel(
            config=tf_config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=optim.use_distributed_optimizer,
            ),
            module=model_chunk,
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=optim.optimizer,
                lr=optim.lr,
                min_lr=optim.min_lr,  # the scheduler reads each param group's max_lr / min_lr
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                adam_eps=optim.adam_eps,
                sgd_momentum=optim.sgd_momentum,
                clip_grad=optim.clip_grad,
                use_distributed_optimizer=optim.use_distributed_optimizer,
                params_dtype=tf_config.params_dtype,
                bf16=tf_config.bf16 and half,
                fp16=tf_config.fp16 and half,
            ),
            [ddp],
        )
    weight_gradients_into_main_grad(ddp)
    fused_adam(optimizer)
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.no_sync_func = ddp.no_sync
    if half and (tf_config.bf16 or tf_config.fp16):
        tf_config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer


def make_scheduler(optimizer, optim: OptimConfig):
    """Megatron's learning-rate scheduler for ``optim`` (warmup, then constant / linear / cosine decay), counted in
    optimizer steps. Step it by one *before* each optimizer step, so step k uses the rate for k."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    constant = optim.lr_decay_style == "constant"
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_steps else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.lr if constant else optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=optim.lr_warmup_steps + 1 if constant else optim.lr_decay_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
