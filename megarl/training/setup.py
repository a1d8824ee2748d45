"""Wrap a model chunk for training: Megatron DDP (grad buffers, DP all-reduce) and the Megatron optimizer."""

from __future__ import annotations

from megarl.compat import megatron_mode
from megarl.config.schema import OptimConfig


def wrap_for_training(model_chunk, optim: OptimConfig):
    """Return (ddp_model, optimizer) for one model chunk, wired so Megatron's schedules finalize gradients."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    tf_config = model_chunk.config
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
                weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1,
                adam_beta2=optim.adam_beta2,
                adam_eps=optim.adam_eps,
                sgd_momentum=optim.sgd_momentum,
                clip_grad=optim.clip_grad,
                use_distributed_optimizer=optim.use_distributed_optimizer,
                params_dtype=tf_config.params_dtype,
                bf16=tf_config.bf16,
                fp16=tf_config.fp16,
            ),
            [ddp],
        )
    tf_config.finalize_model_grads_func = finalize_model_grads
    tf_config.no_sync_func = ddp.no_sync
    if tf_config.bf16 or tf_config.fp16:
        tf_config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer
