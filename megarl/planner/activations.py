"""What a Megatron model chunk saves for backward, tensor by tensor: the activation bytes of ``megarl plan``.

Every count below is a tensor that autograd keeps from the forward to the backward of one micro-batch, with views of
one storage counted once, as ``tests/test_plan_activations.py`` counts them (``torch.autograd.graph.
saved_tensors_hooks`` over a real model, on CPU). A micro-batch is ``n`` sequences right-padded to ``s`` tokens
(``megarl.backend.batch``): most terms are per token (``n * s``), attention's scores are per sequence (``n * s * s``),
RoPE's cos/sin per position (``s``), once per stage.

Notation, per tensor-parallel rank: ``b`` the model dtype's bytes, ``h`` hidden, ``a``/``g`` query/KV heads of this
rank (heads / TP), ``d`` head dim, ``f`` FFN width of this rank, ``v`` vocabulary rows of this rank. Sequence
parallelism is off in megarl, so norms and the inputs of the column-parallel linears hold the full ``h`` on every
TP rank. Per token and layer:

====================  ===================================================  ====================================
where                 saved                                                bytes per token
====================  ===================================================  ====================================
each RMSNorm (x2)     its input, 1/rms in fp32 (CUDA's fused kernel; on    ``b h + 4``
                      CPU ``megarl.compat.megatron_speed.rms_norm_on_cpu``)
linear_qkv            its input (the normed hidden state)                  ``b h``
attention: sdpa       q and k rotated, v (a view of the fused QKV output:  ``b ((a + g) d + (a + 2g) d + a d)``
                      all of it), the output (linear_proj's input, a       ``+ 4 a``
                      view), one fp32 log-sum-exp per head
attention: unfused    q rotated and K/V repeated to the query heads (GQA;  ``b (3 a d + a d)`` (GQA) or
                      without GQA: q, k and v's view as sdpa), the         ``b ((a + g) d + (a + 2g) d + a d)``,
                      context (linear_proj's input), softmax probabilities ``+ 4 a s`` ``(+ b a s`` if ``b < 4)``
                      in fp32 and, below fp32, their cast for the matmul
q/k norms (Qwen3)     1/rms per head in fp32; under GQA q's input (its      ``4 (a + g)`` (``+ b a d`` if GQA)
                      reshape copies a strided view), k's is a view
MLP (SwiGLU)          local spec: fc1's input and output (all              ``b (h + 2f + f)``
                      ``megarl.models.swiglu`` keeps), fc2's input
                      TE spec (Megatron's GLU): also silu(gate) and        ``b (h + 2f + f + f + f)``
                      up + 0 (it adds its GLU offset)
routed experts        instead of the MLP row: the router's input, top-k     ``b h + 20 k + 5 E + k (b h + 4``
(Qwen3-MoE, EP = 1)   and dispatch bookkeeping, per routed copy the         ``+ 4 b f)`` (``+ 4 E + 8 k`` with
                      permuted token and the expert's SwiGLU                the load-balancing term trained on)
                      (``Model.routed_mlp_bytes``)
====================  ===================================================  ====================================

Per micro-batch and layer: the unfused causal mask, ``s * s`` bools. Per stage: RoPE's cos and sin, ``2 b s d``,
computed once for every layer, q and k, and micro-batch of that length (``compat.megatron_speed.rope_in_four_ops``).
First stage: the token ids (``8`` per token). Last stage: the final norm, the output layer's input (``b h``) and the
loss: the actor's log-probs (``megarl.algos.vocab_parallel_logprobs``) keep the softmax over the slice's true
vocabulary in fp32 (``4 v``, padding rows excluded) and the target's index and mask (``9``), and with an entropy
bonus 13 bytes per logit of the slice (``ENTROPY_BONUS_BYTES``); a critic's value head keeps its input (``b h``) and
the fp32 value (``4``).

With recompute (Megatron full, uniform, one layer per checkpoint) a layer keeps only its input (``b h``) until its
backward recomputes it, when that one layer holds its whole set again. Under PP, Megatron's 1F1B schedule keeps up to
``PP - stage`` micro-batches in flight on a stage; the planner counts all of them.

Not saved, and planned as their own line (``logits_transient_bytes``): the model-dtype logits and their fp32 copies
(the upcast, the entropy metric's product with the softmax, the gradient on its way back) alive around the loss.
Transformer Engine's layers save what its fused kernels keep; they are planned with the sdpa row and the norms' (an
estimate, not counted on CPU). In fp32 on CUDA the sdpa module repeats K/V to the query heads
(``megarl.models.attention``), which keeps ``2 (a - g) d`` more per token than the sdpa row says: fp32 is not a GPU
production dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.spec import ModelSpec

FP32 = 4
TOKEN_ID_BYTES = 8  # int64 token ids kept by the embedding
ENTROPY_BONUS_BYTES = 13
"""A differentiable entropy bonus (``vocab_parallel_entropy``) keeps per logit of the slice its mask (1), the
exponentials (4), the masked logits (4) and the shifted logits (4); and as many bytes per token of sums."""
TARGET_MASK_BYTES = 9  # the log-probs' int64 target index within the slice and its bool "in this slice" mask


@dataclass(frozen=True)
class MicroBatchShape:
    """One micro-batch: ``tokens`` in all (sequences x their padded length), none longer than ``length``."""

    tokens: int
    """Tokens in the micro-batch, padding included."""
    length: int
    """Padded length of its sequences (its longest sequence): the per-sequence terms grow with it."""


@dataclass(frozen=True)
class Kernels:
    """Which implementation runs: what it saves differs."""

    attention: str = "sdpa"
    """'sdpa' (fused, no scores kept) or 'unfused' (Megatron's DotProductAttention)."""
    megatron_glu: bool = False
    """Megatron's own SwiGLU (the Transformer Engine spec) keeps silu(gate) and up + 0 beside fc1's output;
    ``megarl.models.swiglu`` (the local spec) keeps fc1's output only."""


@dataclass(frozen=True)
class Model:
    """The model as one TP rank of one pipeline stage sees it."""

    spec: ModelSpec
    """The architecture."""
    dtype_bytes: int
    """Bytes per element of the model dtype."""
    tp: int = 1
    """Tensor-parallel degree."""
    kernels: Kernels = Kernels()
    """What the device's kernels save."""
    load_balancing: bool = False
    """Routed experts whose load-balancing term is trained on (``actor.moe_aux_loss_coef`` > 0): its router
    softmax and top-k stay for backward too (``megarl.backend.moe``)."""

    def _per_rank(self, n: int) -> int:
        return n // self.tp

    def norm_bytes(self, tokens: int) -> int:
        h = self.spec.hidden_size
        return tokens * (self.dtype_bytes * h + FP32)

    def layer_bytes(self, mb: MicroBatchShape, routed: bool = False) -> int:
        """Saved by one transformer layer for one micro-batch (``routed``: its MLP is routed experts)."""
        s, b, T = self.spec, self.dtype_bytes, mb.tokens
        h, d = s.hidden_size, s.head_dim
        a, g, f = self._per_rank(s.num_heads), self._per_rank(s.num_kv_heads), self._per_rank(s.ffn_hidden_size)
        total = 2 * self.norm_bytes(T) + T * b * h  # two norms, linear_qkv's input
        q_k, qkv, out = (a + g) * d, (a + 2 * g) * d, a * d  # rotated q and k; the fused QKV output; attention's
        if self.kernels.attention == "sdpa":
            total += T * (b * (q_k + qkv + out) + FP32 * a)  # v is a view of the QKV output: all of it stays
        else:  # GQA: q, and K/V repeated to the query heads (new tensors); else q, k and v's view as with sdpa
            kept = 3 * a * d if g < a else q_k + qkv
            probs = FP32 * a * mb.length + (b * a * mb.length if b < FP32 else 0)
            total += T * (b * (kept + out) + probs) + mb.length * mb.length  # + the causal mask
        if s.qk_norm:  # Qwen3's per-head norms: 1/rms per head in fp32; under GQA q's input is a copy (a reshape of a
            total += T * (FP32 * (a + g) + (b * a * d if g < a else 0))  # strided view), k's a view of the QKV output
        if routed:
            return total + T * self.routed_mlp_bytes()
        total += T * b * (h + 3 * f)  # fc1 in, fc1 out (2f: all megarl's SwiGLU keeps), fc2 in
        total += T * b * 2 * f if self.kernels.megatron_glu else 0  # silu(gate), up + 0
        return total

    def routed_mlp_bytes(self) -> int:
        """Per token, a routed-expert MLP (local spec, EP = 1; counted on CPU): the router's input (``b h``), its top-k
        indices (int64) and probabilities (fp32), the dispatcher's routing map (bool) and probabilities (fp32) per
        expert and its sorted indices (int64, per routed copy); per routed copy (``k`` of them) the permuted token
        (``b h``: each expert's fc1 input is a view of it), its probability (fp32) and the expert's SwiGLU (fc1 out
        ``2 f``, the activation and its product with the probability, fc2's input: ``b 4 f``). With the load-balancing
        term trained on, its softmax (fp32 per expert) and top-k indices too."""
        s, b = self.spec, self.dtype_bytes
        h, k, E, f = s.hidden_size, s.moe_top_k, s.num_experts, self._per_rank(s.moe_ffn_hidden_size)
        router = b * h + (TOKEN_ID_BYTES + FP32) * k + (1 + FP32) * E + TOKEN_ID_BYTES * k
        experts = k * (b * h + FP32 + b * 4 * f)
        balancing = FP32 * E + TOKEN_ID_BYTES * k if self.load_balancing else 0
        return router + experts + balancing

    def rope_bytes(self, mb: MicroBatchShape) -> int:
        """RoPE's cos and sin at the micro-batch's length: one pair for the stage (its layers, q and k and its
        micro-batches in flight share it)."""
        return 2 * self.dtype_bytes * mb.length * self.spec.head_dim

    def recomputed_layer_bytes(self, mb: MicroBatchShape) -> int:
        """What a checkpointed layer keeps between forward and backward: its input."""
        return mb.tokens * self.dtype_bytes * self.spec.hidden_size

    def last_stage_bytes(self, mb: MicroBatchShape, value_head: bool, entropy_bonus: bool = False) -> int:
        """The final norm, the output layer's input and what the loss keeps (``entropy_bonus``: the actor's
        ``entropy_coeff`` is not 0, so the entropy is differentiated too)."""
        T, b, h = mb.tokens, self.dtype_bytes, self.spec.hidden_size
        if value_head:
            return self.norm_bytes(T) + T * (b * h + FP32)
        rows = self._per_rank(self.spec.padded_vocab_size)
        true_rows = min(rows, self.spec.vocab_size)  # TP rank 0's slice: no padding rows
        loss = T * (FP32 * true_rows + TARGET_MASK_BYTES)
        loss += T * ENTROPY_BONUS_BYTES * (rows + 1) if entropy_bonus else 0
        return self.norm_bytes(T) + T * b * h + loss


def stage_activation_bytes(
    model: Model,
    mb: MicroBatchShape,
    *,
    layers: int,
    first: bool,
    last: bool,
    in_flight: int = 1,
    recompute: bool = False,
    value_head: bool = False,
    entropy_bonus: bool = False,
    routed: int = 0,
) -> int:
    """Peak bytes saved for backward on one pipeline stage holding ``layers`` layers (``routed`` of them with
    routed-expert MLPs), with ``in_flight`` micro-batches between their forward and backward (1F1B: PP - stage)."""
    last_bytes = model.last_stage_bytes(mb, value_head, entropy_bonus) if last else 0
    ends = (mb.tokens * TOKEN_ID_BYTES if first else 0) + last_bytes
    rope = model.rope_bytes(mb) if layers else 0
    if not recompute:
        saved = (layers - routed) * model.layer_bytes(mb) + routed * model.layer_bytes(mb, routed=True)
        return rope + in_flight * (saved + ends)
    kept = layers * model.recomputed_layer_bytes(mb)
    kinds = ([False] if routed < layers else []) + ([True] if routed else [])  # the stage's layers: dense, routed
    recomputed = max(model.layer_bytes(mb, routed=r) for r in kinds)  # the largest is recomputed at some point
    recomputed -= model.recomputed_layer_bytes(mb)  # its first norm keeps the very input the checkpoint holds
    # the loss's tensors are freed before the last layer's backward recomputes it: the larger of the two is the peak
    return rope + in_flight * kept + (in_flight - 1) * ends + max(ends, recomputed)


def logits_transient_bytes(model: Model, mb: MicroBatchShape) -> int:
    """The actor's logits around the loss, not saved for backward: the model-dtype logits and two fp32 copies
    (the upcast and the entropy metric's product in the forward; the gradient and its cast in the backward) on the last
    stage. An estimate: the allocator's order decides which of them meet."""
    return mb.tokens * model._per_rank(model.spec.padded_vocab_size) * (model.dtype_bytes + 2 * FP32)
