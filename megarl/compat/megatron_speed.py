"""Speed-ups of megatron-core's local path that leave what it computes unchanged (bitwise, or within rounding where
said): copies removed, the logits the loss does not score skipped, fewer passes over memory where torch's CPU
kernels compose many (Adam, RMSNorm's backward, RoPE).

Measured on the CPU benchmark (``benchmarks/train_step.py``, torch.profiler, one step of 8 x 256 tokens of a 34M Llama):
- ``batch_major_logits``: ``GPTModel._postprocess`` returns ``logits.transpose(0, 1).contiguous()``: the [s, b, v]
  logits are copied to [b, s, v] on the forward and their gradient copied back on the backward, twice the size of
  the whole vocabulary per token (54 ms of copies per step there, the largest tensors of the step). The output
  layer here computes the same logits from the [b, s, h] hidden states (a copy of h values per token instead of v)
  and hands them on as a [s, b, v] view of [b, s, v] memory, so the transpose back is a view and ``contiguous`` is a
  no-op. Every logit is the same dot product, bitwise. Megatron's own cross-entropy (``labels=``) gets its logits
  contiguous in [s, b, v] again (its ``view`` needs that layout).
- ``logits_from``: the same layer computes logits only from a given position on. An RL loss scores response tokens
  only, yet the output layer (a fifth of SmolLM2-135M's FLOPs) and the whole-vocabulary log-softmax ran at every
  prompt position too, their gradients zero there. Positions before the first response token of a micro-batch are
  skipped (``benchmarks/train_step.py --model DIR --prompt P``: ``megarl-sdpa`` beside ``megarl-sdpa-all-logits``).
- ``multi_tensor_fallbacks_in_place``: without apex or Transformer Engine, Megatron clips gradients with
  ``local_multi_tensor_scale`` (``dst.copy_(src * scale)``: a new tensor the size of each gradient, written and
  copied back) and takes their norm with ``local_multi_tensor_l2_norm`` (a ``torch.norm`` per tensor, each read back
  to the host one by one: a device sync per parameter on a GPU). Here clipping multiplies in place
  (``torch._foreach_mul_``, the same products) and the norm is ``torch._foreach_norm`` and one norm of the norms,
  left on the device. At SmolLM2-135M, clipping took 0.3 s per step on the 113 MB embedding gradient alone (one
  CPU thread); in place, 9 ms. The mixed-precision optimizer's copy of its fp32 main parameters into the bf16
  model goes through the same fallback (``main * 1.0`` into a new fp32 tensor per parameter, then a copy): here one
  converting ``torch._foreach_copy_`` (the same rounding).
- ``weight_gradients_into_main_grad``: Megatron's linear layers return each weight gradient as a new tensor, which
  DDP's hook then adds into the parameter's ``main_grad`` (a pass over every weight gradient per micro-batch, and a
  weight-sized temporary). Megatron's ``gradient_accumulation_fusion`` accumulates it in the GEMM instead, through
  apex's CUDA extension ``fused_weight_gradient_mlp_cuda``; without apex the option is refused. The extension's
  two functions are stood in by ``torch.addmm_`` into ``main_grad`` (``_WeightGradientAccumulation``), and the
  option is turned on for the linear layers whose weight has a ``main_grad`` (a model wrapped for training). One
  GEMM only where the weight and ``main_grad`` share a dtype (fp32 training, the CPU's); bf16 weights with an fp32
  ``main_grad`` still take the GEMM and an add (no temporary kept past the add, no hook), as apex's kernel is not
  there to accumulate bf16 products in fp32.
- ``fused_adam``: Megatron's torch Adam with torch's default implementation is, on CPU tensors, a loop over
  the parameters of ~10 elementwise passes each (on CUDA the same passes, multi-tensor); torch's ``fused`` option
  (one pass per tensor, as apex's and TE's FusedAdam) is set on the groups whose parameters are on the CPU or a GPU
  (parameters and moments equal within ~1 ulp). 66 -> 22 ms per step at 34M (two threads).
- ``rms_norm_on_cpu``: the local spec's norms are ``torch.nn.RMSNorm``, which on CPU tensors torch computes from
  autograd's pieces (pow, mean, rsqrt and two products forward; about ten passes backward, ``div`` and ``pow``
  included), saving the input and the normalised input in fp32 (CUDA has a fused kernel for both directions). Here
  the forward is torch's own (``aten._fused_rms_norm``: the same values, bitwise) and the backward one function
  in fp32 from the input and 1/rms, the two tensors the CUDA kernel saves (``megarl.planner.activations`` plans
  that on both devices): input gradients within ~1e-7 of torch's (a different order of the same sums). At
  SmolLM2-135M's shape (32 x 66 tokens of 576) forward and backward: 11.3 -> 9.0 ms per norm (one thread).
- ``rope_in_four_ops``: ``_apply_rotary_pos_emb_bshd`` computes ``t * cos + rotate_half(t) * sin`` from
  autograd's pieces (cos and sin of the angles, times mscale, cast, in every call; ``chunk``, ``neg``, ``cat``, two
  products and a sum; as many again in backward) and ends with ``torch.cat((t, t_pass))`` where ``t_pass`` (the
  dimensions past the rotary ones) is empty for every model megarl supports: one more copy of q and of k per layer.
  Here it is ``t * cos + roll(t) * sin'`` with ``sin'`` the sine with its first half negated, cos and sin' computed
  once per micro-batch (Megatron hands the same angles to every layer, q and k): the same products
  and sums in the same dtype, so forward and gradient are bitwise Megatron's, and it saves only cos and sin', as
  Megatron's saves cos and sin. Forward and backward of q and k at SmolLM2-135M's shape (32 x 66 tokens, 9 query
  and 3 KV heads of 64): 9.3 -> 6.0 ms per layer (one thread) with a first version that rotated each half in
  place; this one issues four ops each way, none from Python in backward, which a GPU's host pays for per launch.
  Partial, interleaved and multi-latent rotary keep Megatron's code.
- ``no_tp_mappings_on_one_rank``: at TP=1 every ``ColumnParallelLinear`` passes its input through
  ``copy_to_tensor_model_parallel_region`` (at TP > 1 it all-reduces the input's gradient in its own function) and
  every ``RowParallelLinear`` (and the vocabulary-parallel embedding) its output through
  ``reduce_from_tensor_model_parallel_region``: an autograd function each, forward and backward, whose all-reduce
  is skipped when the TP group has one rank. With one rank the tensor is passed on as it is: the
  same values both ways, and 66 autograd functions fewer per micro-batch of the 1.2B model (16 layers), each a
  few Python calls the host makes before a GPU's kernels can run. ``benchmarks/train_step.py --host`` (CPU, width
  64, the step is the host's issuing): megarl's step 1.09x the transformers step without it, 1.03x with it (three
  runs each, alternated).
- ``linear_without_communication``: every linear layer's GEMMs go through Megatron's
  ``linear_with_grad_accumulation_and_async_allreduce``: a wrapper (a deprecation check, the TP group looked up, a
  warning flag) and an autograd function whose forward and backward branch over sequence parallelism, dgrad
  all-reduces, deferred weight gradients and FSDP around their two or three GEMMs. Where there is nothing of that
  to do (every layer at TP=1 without sequence parallelism; the row-parallel ones at any TP) the same GEMMs run in a
  function without the branches: bitwise the same outputs and gradients (``tests/test_compat.py``), weight
  gradients into ``main_grad`` by the same accumulation, DDP's hook given a placeholder as Megatron's. ``--host``:
  megarl's step 1.00x the transformers step without it, 0.98x with it (two runs, ``--without-compat --steps 20``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.autograd.function import once_differentiable

from megarl.compat.compiled import compiled_kernel
from megarl.compat.megatron_fixes import _applies  # the same megatron-core versions


def batch_major_logits(model) -> bool:
    """Make ``model.output_layer`` (a ``ColumnParallelLinear`` without sequence parallelism) lay its logits out
    batch-major; returns whether it did (a critic's value head, or another version of megatron-core, is left as is).
    The class is swapped, not the module: parameter names, checkpoints and copies of the model are unchanged."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    layer = getattr(model, "output_layer", None)
    if not _applies() or type(layer) is not ColumnParallelLinear or layer.sequence_parallel:
        return False
    layer.__class__ = _BatchMajorOutputLayer
    _contiguous_logits_for_the_lm_loss()
    return True


@contextmanager
def logits_from(model_chunk, position: int) -> Iterator[int]:
    """Within the block, ``model_chunk``'s output layer computes logits only at sequence positions ``>= position``
    (the forward returns [b, S - first, v] logits). Yields ``first``: ``position``, or 0 where the layer cannot
    (no batch-major output layer: another stage of a pipeline, a value head, sequence parallelism). Positions
    before ``first`` must score nothing: their hidden states get no gradient from the output layer."""
    while not hasattr(model_chunk, "output_layer") and hasattr(model_chunk, "module"):
        model_chunk = model_chunk.module  # DDP, Float16Module
    layer = getattr(model_chunk, "output_layer", None)
    if not isinstance(layer, _BatchMajorOutputLayer) or position <= 0:
        yield 0
        return
    layer.first_position = position
    try:
        yield position
    finally:
        layer.first_position = 0


def _contiguous_logits_for_the_lm_loss() -> None:
    """Megatron's own loss (``labels=``) views the [s, b, v] logits as [s x b, v]: it gets them laid out as it made
    them (the copy batch-major logits save the trainer's losses; idempotent)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.compute_language_model_loss
    if getattr(original, "megarl_patched", False):
        return

    def compute_language_model_loss(self, labels, logits):
        return original(self, labels, logits.contiguous())

    compute_language_model_loss.megarl_patched = True
    LanguageModule.compute_language_model_loss = compute_language_model_loss


def _batch_major_output_layer():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class BatchMajorOutputLayer(ColumnParallelLinear):
        """``ColumnParallelLinear`` on [s, b, h] returning its [s, b, v] output as a view of [b, s, v] memory; from
        position ``first_position`` on (``logits_from``)."""

        first_position = 0

        def forward(self, input_, weight=None, runtime_gather_output=None):
            hidden_BSH = input_[self.first_position :].transpose(0, 1).contiguous()
            logits_BSV, bias = super().forward(hidden_BSH, weight=weight, runtime_gather_output=runtime_gather_output)
            return logits_BSV.transpose(0, 1), bias

    return BatchMajorOutputLayer


_BatchMajorOutputLayer = _batch_major_output_layer()


def rms_norm_on_cpu(model, compiled: bool = False) -> int:
    """Swap the class of ``model``'s ``torch.nn.RMSNorm`` modules (the local spec's norms) for one whose backward on
    CPU tensors is a single function (see the module docstring; other devices keep torch's); returns how many. As
    ``batch_major_logits``: parameter names, checkpoints and copies are unchanged. ``compiled``: its forward and that
    backward are kernels generated by torch.compile (``megarl.compat.compiled``)."""
    swapped = 0
    for module in model.modules():
        if type(module) is torch.nn.RMSNorm and module.elementwise_affine:
            module.__class__ = _CompiledRMSNormOnCPU if compiled else _RMSNormOnCPU
            swapped += 1
    return swapped


class _RMSNormOnCPU(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with ``_RMSNormFunction`` on CPU tensors."""

    compiled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or len(self.normalized_shape) != 1:
            return super().forward(x)
        # eps None: torch's own default, as F.rms_norm's
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.compiled)


class _CompiledRMSNormOnCPU(_RMSNormOnCPU):
    """``_RMSNormOnCPU`` whose forward and backward are torch.compile's kernels (``model.compile_elementwise``)."""

    compiled = True


class _RMSNormFunction(torch.autograd.Function):
    """``x / rms(x) * weight`` over the last dimension; saves the input and 1/rms (fp32, or fp64 for fp64 input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float | None, compiled: bool = False) -> torch.Tensor:
        out, rstd = (compiled_kernel(_rms_norm) if compiled else _rms_norm)(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.compiled = compiled
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        want_x, want_weight = ctx.needs_input_grad[:2]
        if ctx.compiled:
            grad_x, grad_weight = compiled_kernel(_rms_norm_backward)(x, weight, rstd, grad, want_x, want_weight)
            return grad_x, grad_weight, None, None
        h, dtype = x.shape[-1], rstd.dtype
        normed = x.to(dtype) * rstd  # x / rms
        grad_up = grad.to(dtype)
        grad_weight = None
        if want_weight:  # sum over tokens of g * normed
            grad_weight = torch.linalg.vecdot(grad_up.reshape(-1, h).t(), normed.reshape(-1, h).t()).to(weight.dtype)
        grad_x = None
        if want_x:  # d/dx of x * rstd: rstd * (g' - normed * mean(g' * normed)), g' = g * weight
            grad_normed = grad_up * weight.to(dtype)
            mean = torch.linalg.vecdot(grad_normed, normed).unsqueeze(-1).mul_(1.0 / h)
            grad_x = grad_normed.sub_(normed.mul_(mean)).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None, None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch's RMSNorm (on CPU a chain of its elementwise kernels): (output, 1/rms)."""
    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)


def _rms_norm_backward(x, weight, rstd, grad, want_x: bool, want_weight: bool):
    """``_RMSNormFunction``'s backward as expressions, for torch.compile: (grad_x, grad_weight), None where not
    wanted."""
    h, dtype = x.shape[-1], rstd.dtype
    normed = x.to(dtype) * rstd
    grad_up = grad.to(dtype)
    grad_weight = (grad_up * normed).reshape(-1, h).sum(0).to(weight.dtype) if want_weight else None
    grad_x = None
    if want_x:
        grad_normed = grad_up * weight.to(dtype)
        mean = (grad_normed * normed).sum(-1, keepdim=True) / h
        grad_x = ((grad_normed - normed * mean) * rstd).to(x.dtype)
    return grad_x, grad_weight


def rope_in_four_ops() -> bool:
    """Patch megatron-core's unfused RoPE (``_apply_rotary_pos_emb_bshd``) where every dimension is rotated in halves
    (not interleaved, not multi-latent) to ``t * cos + roll(t) * sin'`` (``roll(t) = [t2, t1]``, ``sin' = [-sin1,
    sin2]``, both kept for the last angles tensor): four ops forward and four in autograd's backward, none in
    Python, for Megatron's ten or so (its cos and sin per call, chunk, neg, cat and the pass-through part's cat). The
    same products and sums: bitwise Megatron's. Idempotent; returns whether the patch is in place."""
    if not _applies():
        return False
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd
    if getattr(original, "megarl_patched", False):
        return True

    def apply_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        # Megatron's code: partial, interleaved, multi-latent; angles that take a gradient or widen t
        if multi_latent_attention or rotary_interleaved or not _rotates_whole_in_halves(t, freqs):
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos, signed_sin = _cos_sin(freqs, mscale, t.dtype)
        # rotate_half(t) * sin = [-t2 s1, t1 s2] = roll(t) * sin'; autograd saves cos and sin' only, as Megatron's
        return (t * cos + torch.roll(t, t.shape[-1] // 2, -1) * signed_sin).contiguous()  # contiguous as its cat

    apply_bshd.megarl_patched, apply_bshd.original = True, original
    rope_utils._apply_rotary_pos_emb_bshd = apply_bshd
    return True


def no_tp_mappings_on_one_rank() -> bool:
    """Patch megatron-core's linear layers' TP mappings (``copy_to_`` / ``reduce_from_tensor_model_parallel_region``,
    as ``tensor_parallel.layers`` calls them) to pass the tensor on unchanged where the TP group has one rank,
    without the autograd function whose all-reduce would be skipped there. Idempotent; returns whether the patch is
    in place."""
    if not _applies():
        return False
    from megatron.core.tensor_parallel import layers

    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"):
        original = getattr(layers, name)
        if not getattr(original, "megarl_patched", False):
            setattr(layers, name, _unless_one_rank(original))
    return True


def _unless_one_rank(mapping):
    def on_more_than_one_rank(input_: torch.Tensor, group=None) -> torch.Tensor:
        return input_ if group is not None and group.size() == 1 else mapping(input_, group)

    on_more_than_one_rank.megarl_patched, on_more_than_one_rank.original = True, mapping
    return on_more_than_one_rank


def linear_without_communication() -> bool:
    """Patch megatron-core's linear layers' function (``linear_with_grad_accumulation_and_async_allreduce``, as
    ``ColumnParallelLinear`` and ``RowParallelLinear`` call it) to ``_LinearWithoutCommunication`` where it has no
    communication to do (no sequence parallelism, no all-reduce of the input's gradient: every linear at TP=1, the
    row-parallel ones at any TP) and no weight gradient to defer; Megatron's function everywhere else. Idempotent;
    returns whether the patch is in place."""
    if not _applies():
        return False
    from megatron.core.tensor_parallel import layers

    original = layers.linear_with_grad_accumulation_and_async_allreduce
    if getattr(original, "megarl_patched", False):
        return True

    def linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
               grad_output_buffer=None, wgrad_deferral_limit=0, async_grad_allreduce=None, tp_group=None):  # fmt: skip
        if (allreduce_dgrad or sequence_parallel or grad_output_buffer is not None or async_grad_allreduce is not None
                or (gradient_accumulation_fusion and (getattr(weight, "main_grad", None) is None
                                                      or getattr(weight, "zero_out_wgrad", False)
                                                      or hasattr(weight, "__fsdp_param__")))):  # fmt: skip
            return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                            grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce, tp_group)  # fmt: skip
        return _LinearWithoutCommunication.apply(input, weight, bias, gradient_accumulation_fusion)

    linear.megarl_patched, linear.original = True, original
    linear.warned = original.warned  # Megatron's function reads and sets it on the module's name: this one
    layers.linear_with_grad_accumulation_and_async_allreduce = linear
    return True


def _linear_without_communication():
    from megatron.core.tensor_parallel import layers
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    class LinearWithoutCommunication(torch.autograd.Function):
        """Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` without its communication, buffers and
        deferral (a few dozen Python operations per call that a GPU's host runs before it can launch the GEMMs):
        the same GEMMs on the same tensors, so outputs and gradients are bitwise its own; the weight gradient is
        accumulated into ``main_grad`` by the same function (apex's, or ``_WeightGradientAccumulation``) where the
        layer fuses it, with a placeholder gradient of the same shape and dtype for DDP's hook (Megatron's; with
        Transformer Engine installed Megatron reuses TE's cached one)."""

        @staticmethod
        @layers.custom_fwd
        def forward(ctx, input, weight, bias, gradient_accumulation_fusion):
            ctx.save_for_backward(input, weight)
            # not saved for backward: a module reused across layers (MTP's logits) would trip the version check
            ctx.main_grad = weight.main_grad if gradient_accumulation_fusion else None
            ctx.use_bias = bias is not None
            output = torch.matmul(input, weight.t())
            return output + bias if bias is not None else output

        @staticmethod
        @layers.custom_bwd
        def backward(ctx, grad_output):
            input, weight = ctx.saved_tensors
            grad_input = grad_output.matmul(weight)
            grad_output, input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, input)
            main_grad = ctx.main_grad
            if main_grad is None:
                grad_weight = grad_output.t().matmul(input_2d)
            else:
                weight.main_grad = main_grad
                fused = layers.fused_weight_gradient_mlp_cuda
                if main_grad.dtype == torch.float32:
                    fused.wgrad_gemm_accum_fp32(input_2d, grad_output, main_grad)
                elif main_grad.dtype in (torch.float16, torch.bfloat16):
                    fused.wgrad_gemm_accum_fp16(input_2d, grad_output, main_grad)
                else:
                    raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
                grad_weight = None
                if hasattr(weight, "grad_added_to_main_grad"):  # DDP's hook runs on the autograd thread, as Megatron's
                    grad_weight = torch.empty(main_grad.shape, dtype=input.dtype, device=input.device)
                    weight.grad_added_to_main_grad = True
            grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
            return grad_input, grad_weight, grad_bias, None

    return LinearWithoutCommunication


_LinearWithoutCommunication = _linear_without_communication()


def compiled_rope_as_megatrons_fusion() -> bool:
    """Plug ``_compiled_rope`` into megatron-core's RoPE-fusion hook (``rope_utils.fused_apply_rotary_pos_emb``,
    Transformer Engine's kernel where TE is installed, else None), so a model whose ``TransformerConfig`` sets
    ``apply_rope_fusion`` (``model.compile_elementwise``) runs it. Leaves TE's kernel in place; idempotent; returns
    whether the hook is megarl's."""
    if not _applies():
        return False
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = _compiled_rope
    return rope_utils.fused_apply_rotary_pos_emb is _compiled_rope


def _compiled_rope(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
                   interleaved: bool = False) -> torch.Tensor:  # fmt: skip
    """``rope_in_four_ops``'s function as one torch.compile kernel each way (``megarl.compat.compiled``), with its
    cos and sin' (kept per angles tensor) the only tensors saved; Megatron's unfused code where that one does."""
    # Megatron's code where rope_in_four_ops uses it (Megatron routes an mscale other than 1 to it itself)
    if interleaved or not _rotates_whole_in_halves(t, freqs):
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    cos, signed_sin = _cos_sin(freqs, 1.0, t.dtype)
    return _RoPE.apply(t, cos, signed_sin)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return compiled_kernel(_rope)(t, cos, signed_sin).contiguous()  # contiguous as Megatron's cat

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, signed_sin = ctx.saved_tensors
        return compiled_kernel(_rope_backward)(grad, cos, signed_sin), None, None


def _rope(t, cos, signed_sin):
    """``t * cos + roll(t) * sin'`` by halves: [t1 c1 + t2 s1', t2 c2 + t1 s2'] (inductor's kernel for ``roll`` on
    dynamic shapes took 13.7 ms for q's forward at SmolLM2's shape, torch's four ops 6.1 ms, this one 1.0 ms)."""
    h = t.shape[-1] // 2
    t1, t2, c1, c2 = t[..., :h], t[..., h:], cos[..., :h], cos[..., h:]
    s1, s2 = signed_sin[..., :h], signed_sin[..., h:]
    return torch.cat([t1 * c1 + t2 * s1, t2 * c2 + t1 * s2], dim=-1)


def _rope_backward(grad, cos, signed_sin):
    """d/dt of ``_rope``: [g1 c1 + g2 s2', g2 c2 + g1 s1']."""
    h = grad.shape[-1] // 2
    g1, g2, c1, c2 = grad[..., :h], grad[..., h:], cos[..., :h], cos[..., h:]
    s1, s2 = signed_sin[..., :h], signed_sin[..., h:]
    return torch.cat([g1 * c1 + g2 * s2, g2 * c2 + g1 * s1], dim=-1)


def _rotates_whole_in_halves(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether megarl's RoPE computes this call (else Megatron's code): every dimension of ``t`` rotated (not
    partial), in two halves of an even width, by angles that take no gradient and do not widen ``t``."""
    return (freqs.shape[-1] == t.shape[-1] and t.shape[-1] % 2 == 0 and not freqs.requires_grad
            and _broadcasts_to(freqs.shape, t.shape))  # fmt: skip


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without widening it (``torch.broadcast_shapes`` builds tensors to
    answer: ~60 us a call, twice per layer)."""
    return len(shape) <= len(target) and all(n in (1, m) for n, m in zip(reversed(shape), reversed(target)))


_KEPT_COS_SIN: list = [None]
"""The last angles tensor's (weak reference, (version, mscale, dtype), cos, sin'): one pair kept, whatever the
number of lengths Megatron's rotary embedding has cached."""


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos(freqs) * mscale`` and ``sin(freqs) * mscale`` with its first half negated, in ``dtype``, as Megatron
    computes them for each call, kept for the last ``freqs`` while its values are unchanged: Megatron's rotary
    embedding hands the same tensor to every layer, to q and k, and to every micro-batch of a length (its forward is
    cached), so they are computed once per micro-batch, not per call (on a GPU each is a launch the host pays for).
    Under inference mode nothing is kept: an inference tensor has no version to check, nor could a later training
    step save it for backward. (A change through ``freqs.data`` bumps no version: Megatron makes none.)"""
    if torch.is_inference_mode_enabled() or freqs.is_inference():
        return _signed_cos_sin(freqs, mscale, dtype)
    key = (freqs._version, mscale, dtype)
    kept = _KEPT_COS_SIN[0]
    if kept is None or kept[0]() is not freqs or kept[1] != key:
        kept = (weakref.ref(freqs), key, *_signed_cos_sin(freqs, mscale, dtype))
        _KEPT_COS_SIN[0] = kept
    return kept[2], kept[3]


def _signed_cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    sin = (torch.sin(freqs) * mscale).to(dtype)
    h = sin.shape[-1] // 2
    return (torch.cos(freqs) * mscale).to(dtype), torch.cat((-sin[..., :h], sin[..., h:]), -1)


def multi_tensor_fallbacks_in_place() -> bool:
    """Make Megatron's local multi-tensor fallbacks (no apex, no Transformer Engine) work without their temporaries
    and host reads: gradient clipping scales in place, the norm stays on the device, and the mixed-precision
    optimizer copies its fp32 main parameters into the model's half ones directly (its fallback computed
    ``main * 1.0``, a new fp32 tensor per parameter, then copied that). Returns whether it did (idempotent)."""
    if not _applies():
        return False
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mixed

    if clip_grads.multi_tensor_scale_impl not in (utils.local_multi_tensor_scale, _scale_without_temporaries):
        return False  # apex's or TE's fused kernels
    for module in (clip_grads, mixed):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _scale_without_temporaries
    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm_on_device
    return True


def _scale_without_temporaries(chunk_size, noop_flag, tensor_lists, scale):
    """``local_multi_tensor_scale`` (``dst.copy_(src * scale)``, a temporary per tensor) as one multi-tensor op: in
    place where ``dst`` is ``src`` (clipping), a converting copy where ``scale`` is 1 (the main parameters into the
    model's: the same rounding as the copy of ``src * 1.0``)."""
    from megatron.core.utils import local_multi_tensor_scale

    sources, targets = tensor_lists
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        if targets:
            torch._foreach_mul_(targets, scale)
    elif scale == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale)


def _l2_norm_on_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``local_multi_tensor_l2_norm``: the l2 norm of all tensors of ``tensor_lists`` as a one-element fp32 tensor
    on their device (no per-tensor norms: ``per_tensor`` is False at Megatron's call)."""
    tensors = [t for tensors in tensor_lists for t in tensors]
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


class _WeightGradientAccumulation:
    """Stands in for apex's ``fused_weight_gradient_mlp_cuda``: ``main_grad += grad_output^T @ input`` (2-D, as
    Megatron calls it), in one GEMM when the dtypes allow it, else the GEMM in the inputs' dtype and an add (what
    Megatron does without the option)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(input_: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        if input_.dtype == main_grad.dtype:
            main_grad.addmm_(grad_output.t(), input_)
        else:
            main_grad.add_(grad_output.t() @ input_)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def weight_gradients_into_main_grad(model) -> int:
    """Accumulate the weight gradients of ``model``'s Megatron linear layers (a DDP-wrapped chunk: its parameters
    have ``main_grad``) directly into ``main_grad``; returns how many layers do. apex's extension is used where it is
    installed, else ``_WeightGradientAccumulation``."""
    if not _applies():
        return 0
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = _WeightGradientAccumulation
        layers._grad_accum_fusion_available = True
    fused = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)) and hasattr(weight, "main_grad"):
            module.gradient_accumulation_fusion = True
            fused += 1
    return fused


FUSED_ADAM_DEVICES = ("cpu", "cuda")
"""Where ``fused_adam`` runs torch's fused Adam kernel (torch has one for both)."""


def fused_adam(optimizer) -> int:
    """Run the torch Adam inside a Megatron optimizer (chained or not) as torch's fused kernel where its parameters
    live on the CPU or a GPU, and as torch's default elsewhere; returns how many parameter groups run fused.

    Without apex or Transformer Engine Megatron builds ``torch.optim.AdamW`` / ``Adam`` with torch's default
    implementation: on CPU tensors a loop over the parameters of ~10 elementwise passes each, on CUDA the
    multi-tensor one (the same ~10 passes over every parameter and moment, batched, with temporaries the size of
    the parameters). ``fused`` is a documented option of both classes, read from the parameter group at every step;
    the fused kernel makes one pass per tensor (what apex's and TE's FusedAdam do for Megatron on a GPU, and the
    fused AdamW a transformers user sets), parameters and moments equal to within about one ulp
    (``tests/test_compat.py``). Measured: 486 -> 161 ms per step for SmolLM2-135M's fp32 state on one thread, 66 ->
    22 ms at 34M on two. The fused kernel wants each ``step`` in fp32 on its parameter's device (torch's own load
    puts it there for a fused group): a step kept elsewhere is moved. A load (``load_state_dict``) takes the groups'
    flags from the checkpoint, which may come from another device or an older megarl: call again after it."""
    fused = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            devices = {p.device for p in group["params"]}
            on_one = len(devices) == 1 and next(iter(devices)).type in FUSED_ADAM_DEVICES
            if on_one and not group.get("differentiable") and not group.get("capturable"):
                group["fused"], group["foreach"] = True, False
                for p in group["params"]:
                    state = inner.state.get(p, {})
                    step = state.get("step")
                    if step is not None and (step.device != p.device or step.dtype != torch.float32):
                        state["step"] = step.to(p.device, torch.float32)  # the CUDA kernel reads fp32 steps
                fused += 1
            elif group.get("fused"):  # e.g. a CPU run's checkpoint loaded where torch has no fused kernel
                group["fused"], group["foreach"] = None, None
    return fused
