"""model.attention=sdpa (the default) computes what Megatron's unfused core attention computes: equal logits and
gradients of the actor's loss, on right-padded micro-batches, at TP=1, TP=2 and PP=2, with GQA and Qwen2's q/k/v bias
and without GQA; in bf16 to bf16's precision. One spawned world of 2 serves every case."""

from dataclasses import replace

import pytest
import torch

from megarl.models.attention import SdpaAttention
from megarl.models.builder import layer_spec
from megarl.parallel.layout import ParallelLayout as L
from megarl.parallel.spawn import run_on_ranks
from tests.attention_worker import PROMPT_LEN, compare_cases
from tests.parity_worker import tiny_spec

GQA = tiny_spec()  # 4 query heads / 2 KV heads, q/k/v bias (Qwen2)
MHA = replace(tiny_spec(), num_kv_heads=4, qkv_bias=False)
CASES = {
    "tp1": (GQA, L(dp=2)),
    "tp2": (GQA, L(tp=2)),
    "pp2": (GQA, L(pp=2)),
    "tp1_mha": (MHA, L(dp=2)),
    "tp2_mha": (MHA, L(tp=2)),
    "tp1_bf16": (GQA, L(dp=2), "bfloat16"),
    "pp2_bf16": (GQA, L(pp=2), "bfloat16"),
}
SPEEDUP_CASES = {"tp2": (GQA, L(tp=2)), "pp2_bf16": (GQA, L(pp=2), "bfloat16")}
"""``megarl.compat.megatron_speed`` and ``megarl.models.swiglu`` on and off (batch-major logits from the first scored
position, RoPE in four ops, the CPU RMSNorm, weight gradients accumulated by the GEMM, megarl's SwiGLU)."""
FP32_RTOL = 1e-5
BF16_RTOL = 3e-2  # a few bf16 ulps (2^-7 = 7.8e-3): measured 1.0e-2 (logits), 1.6e-2 (gradients)


@pytest.fixture(scope="module")
def world():
    return run_on_ranks(compare_cases, 2, list(CASES.values()), list(SPEEDUP_CASES.values()))


@pytest.fixture(scope="module")
def results(world):
    return dict(zip(CASES, world[0]))


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_equals_the_unfused_attention(results, case):
    r = results[case]
    tol = BF16_RTOL if "bf16" in case else FP32_RTOL
    assert r["logits"] <= tol and r["grads"] <= tol, r
    assert r["logit_batches"] >= 2 and r["grad_norm"] > 0  # both micro-batches compared; gradients not all zero


@pytest.mark.parametrize("case", list(SPEEDUP_CASES))
def test_megatron_speed_changes_no_logit_or_gradient_and_removes_the_logit_copy_and_prompt_logits(world, case):
    r = dict(zip(SPEEDUP_CASES, world[1]))[case]
    tol = BF16_RTOL if "bf16" in case else FP32_RTOL
    assert r["logits"] <= tol and r["grads"] <= tol, r
    assert r["logit_batches"] >= 2 and r["grad_norm"] > 0
    assert r["views"] and all(r["views"]) and not any(r["views_off"]), r  # the [b, s, v] logits: no copy made
    # logits from the first scored position on (prompt positions skipped); all of them without the speed-ups; the
    # loss runs without the CPU shim's torch function mode (compat.cpu), as the forward does
    assert r["firsts"] == [(PROMPT_LEN - 1, None)] * len(r["views"]), r
    assert r["firsts_off"] == [(0, None)] * len(r["views_off"]), r
    # every linear weight of the rank (no bias, norm or embedding) accumulated by the GEMM, every MLP on megarl's
    # SwiGLU, every norm on megarl's CPU RMSNorm, RoPE in four ops; none of them without the speed-ups
    # (4 linears and 2 norms per layer, the output layer and final norm on the last stage): TP=2 ranks hold both
    # layers, PP=2 stages one each
    # Megatron's TP mappings in the forward's graph: none where the TP group has one rank (PP=2: without the
    # speed-ups one per linear layer and the stage's embedding or output layer, 5); where it has two, as without the
    # speed-ups (the row-parallel layers' and the embedding's all-reduces, 5: the column-parallel ones all-reduce
    # their input's gradient inside their own function)
    mappings = [0, 0] if "pp" in case else [5, 5]
    # the model's forward runs without the CPU shim's torch function mode (compat.cpu), with the speed-ups or not
    expected = [(4, 1, 2, 1), (5, 1, 3, 1)] if "pp" in case else [(9, 2, 5, 1), (9, 2, 5, 1)]
    assert r["fused"] == [(*e, None, m) for e, m in zip(expected, mappings)], r
    assert r["fused_off"] == [(0, 0, 0, 0, None, 5)] * 2, r
    if "pp" not in case:  # Megatron's own cross-entropy (labels=) on a micro-batch of two: unchanged
        assert r["lm_loss"] is not None and r["lm_loss"] <= tol, r


def test_the_output_layer_keeps_its_names_and_copies_of_the_model_keep_the_swap():
    import copy

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megarl.compat.megatron_speed import batch_major_logits

    class Model(torch.nn.Module):  # a stand-in holding an output layer as GPTModel does (no process group needed)
        def __init__(self, layer):
            super().__init__()
            self.output_layer = layer

    layer = ColumnParallelLinear.__new__(ColumnParallelLinear)
    torch.nn.Module.__init__(layer)
    layer.weight, layer.sequence_parallel = torch.nn.Parameter(torch.zeros(4, 2)), False
    model = Model(layer)
    names = list(model.state_dict())
    assert batch_major_logits(model) and isinstance(model.output_layer, ColumnParallelLinear)
    assert list(model.state_dict()) == names and "output_layer.weight" in names
    assert type(copy.deepcopy(model).output_layer) is type(model.output_layer)
    layer.__class__, layer.sequence_parallel = ColumnParallelLinear, True
    assert not batch_major_logits(model)  # sequence parallel gathers along s: left as Megatron built it
    model.output_layer = torch.nn.Linear(2, 1)  # a critic's value head
    assert not batch_major_logits(model)


def test_the_local_spec_takes_sdpa_by_default_and_unfused_on_request():
    assert layer_spec("local").submodules.self_attention.submodules.core_attention is SdpaAttention
    core = layer_spec("local", "unfused").submodules.self_attention.submodules.core_attention
    assert core.__name__ == "DotProductAttention"
    with pytest.raises(ValueError, match="model.attention must be one of"):
        layer_spec("local", "flash")


def test_what_sdpa_cannot_compute_is_refused_in_one_line():
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from megarl.models.builder import transformer_config

    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))  # a TP group of one, without a process group
    for field, value in (("attention_dropout", 0.1), ("window_size", (8, 0))):
        config = transformer_config(GQA, L())
        setattr(config, field, value)
        with pytest.raises(ValueError, match=rf"does not support {field}=.*; use model.attention=unfused"):
            SdpaAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank)


def _reference_attention(q, k, v, scale):
    """Causal softmax attention written from the formula; query head i reads K/V head i // (heads / KV heads)."""
    s, b, heads, d = q.shape
    group = heads // k.shape[2]
    out = torch.empty(s, b, heads, d, dtype=torch.float64)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for h in range(heads):
        scores = torch.einsum("ibd,jbd->bij", q[:, :, h].double(), k[:, :, h // group].double()) * scale
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[:, :, h] = torch.einsum("bij,jbd->ibd", probs, v[:, :, h // group].double())
    return out.reshape(s, b, heads * d)


@pytest.mark.parametrize("native", [True, False])  # False: K/V repeated first (what CUDA does in fp32)
def test_sdpa_attention_equals_the_formula_with_shared_or_repeated_kv_heads(native, monkeypatch):
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    import megarl.models.attention as attention
    from megarl.models.builder import transformer_config

    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    module = SdpaAttention(transformer_config(GQA, L()), 1, AttnMaskType.causal, "self", pg_collection=one_rank)
    if not native:
        monkeypatch.setattr(attention, "_native_gqa", lambda query, mask: False)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(6, 2, GQA.num_heads, GQA.head_dim, generator=gen)
    k, v = (torch.randn(6, 2, GQA.num_kv_heads, GQA.head_dim, generator=gen) for _ in range(2))
    got = module(q, k, v, None)
    assert module.scale == pytest.approx(GQA.head_dim**-0.5)  # Megatron: 1 / sqrt(head_dim)
    assert torch.allclose(got.double(), _reference_attention(q, k, v, module.scale), atol=1e-6)


def test_kv_heads_are_shared_natively_on_cpu_and_in_half_precision_on_cuda():
    from types import SimpleNamespace

    from megarl.models.attention import _native_gqa

    def query(cuda, dtype):
        return SimpleNamespace(is_cuda=cuda, dtype=dtype)

    assert _native_gqa(query(False, torch.float32), None)
    assert _native_gqa(query(True, torch.bfloat16), None)
    assert not _native_gqa(query(True, torch.float32), None)  # torch would take its math backend
    assert not _native_gqa(query(True, torch.bfloat16), torch.ones(1, dtype=torch.bool))


def test_rope_in_four_ops_equals_megatron_rope_and_its_gradient_bitwise():
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.compat.megatron_speed import rope_in_four_ops

    assert rope_in_four_ops() and rope_in_four_ops()  # idempotent
    patched = rope_utils._apply_rotary_pos_emb_bshd
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(5, 2, 3, 8, generator=gen)
    grad = torch.randn(5, 2, 3, 8, generator=gen)
    # every dimension rotated (this module's function, mscale too); partial or interleaved rotary (Megatron's own)
    for rotary, interleaved, mscale in ((8, False, 1.0), (8, False, 0.7), (4, False, 1.0), (8, True, 1.0)):
        freqs = torch.randn(5, 1, 1, rotary, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            outs = []
            for fn in (patched, patched.original):
                x = t.to(dtype).clone().requires_grad_()
                out = fn(x, freqs, rotary_interleaved=interleaved, mscale=mscale)
                out.backward(grad.to(dtype))
                outs.append((out.detach(), x.grad))
            (out, dx), (ref, ref_dx) = outs
            assert out.dtype == ref.dtype == dx.dtype == dtype
            assert torch.equal(out, ref) and torch.equal(dx, ref_dx), (rotary, interleaved, mscale, dtype)
    permuted = t.transpose(0, 1).contiguous().transpose(0, 1)  # [s, b, n, d] laid out batch-major
    out = patched(permuted, torch.randn(5, 1, 1, 8, generator=gen))
    assert out.is_contiguous()  # as Megatron's cat returns it (its callers view it)
    freqs = torch.randn(5, 1, 1, 8, generator=gen, requires_grad=True)  # angles that take a gradient: Megatron's
    patched(t, freqs).sum().backward()
    assert freqs.grad is not None


@pytest.mark.parametrize("shape", [(5, 1, 1, 8), (1, 1, 8), (8,), (5, 2, 3, 8), (5, 2, 1, 8), (5, 4, 1, 8),
                                   (2, 5, 1, 1, 8), (1, 5, 2, 3, 8), (5, 1, 1, 1)])  # fmt: skip
def test_the_rope_shape_check_agrees_with_torch_broadcasting(shape):
    from megarl.compat.megatron_speed import _broadcasts_to

    target = torch.Size((5, 2, 3, 8))
    try:
        same = torch.broadcast_shapes(target, shape) == target
    except RuntimeError:
        same = False
    assert _broadcasts_to(torch.Size(shape), target) is same


def test_rope_cos_and_sin_are_computed_once_per_angles_tensor_while_it_is_unchanged():
    from megarl.compat.megatron_speed import _cos_sin

    freqs = torch.randn(5, 1, 1, 8, generator=torch.Generator().manual_seed(0))
    cos, sin = _cos_sin(freqs, 1.0, torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16 and torch.equal(cos, torch.cos(freqs).to(torch.bfloat16))
    assert torch.equal(sin, (torch.sin(freqs) * torch.tensor([-1.0] * 4 + [1.0] * 4)).to(torch.bfloat16))  # [-s1, s2]
    again = _cos_sin(freqs, 1.0, torch.bfloat16)
    assert again[0] is cos and again[1] is sin  # q and k, every layer and micro-batch: one computation
    assert torch.equal(_cos_sin(freqs, 0.5, torch.float32)[1][..., 4:], torch.sin(freqs)[..., 4:] * 0.5)  # mscale
    freqs.mul_(2)  # changed in place: computed again
    assert torch.equal(_cos_sin(freqs, 1.0, torch.bfloat16)[0], torch.cos(freqs).to(torch.bfloat16))
    other = freqs.clone() + 1  # another length's angles: computed, and the first ones again after them
    assert torch.equal(_cos_sin(other, 1.0, torch.bfloat16)[0], torch.cos(other).to(torch.bfloat16))
    assert torch.equal(_cos_sin(freqs, 1.0, torch.bfloat16)[0], torch.cos(freqs).to(torch.bfloat16))


def test_rope_under_inference_mode_keeps_nothing_a_training_step_would_trip_on():
    """Megatron caches its angles across calls: ones made under inference mode, or a first call under it, must not
    leave inference tensors behind for a later backward."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.compat.megatron_speed import rope_in_four_ops

    assert rope_in_four_ops()
    patched = rope_utils._apply_rotary_pos_emb_bshd
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(5, 2, 3, 8, generator=gen)
    with torch.inference_mode():
        inference_freqs = torch.randn(5, 1, 1, 8, generator=gen)
    freqs = torch.randn(5, 1, 1, 8, generator=gen)
    with torch.inference_mode():
        assert torch.equal(patched(t, freqs), patched.original(t, freqs))  # the first call, in inference mode
    for angles in (freqs, inference_freqs):
        x, y = t.clone().requires_grad_(), t.clone().requires_grad_()
        patched(x, angles).sum().backward()
        patched.original(y, angles).sum().backward()
        assert torch.equal(x.grad, y.grad)


def test_rope_of_q_and_k_sliced_from_the_fused_qkv_output_is_megatrons_bitwise():
    """As Megatron's attention hands them over: views of one [s, b, g, (a/g + 2) d] tensor, not contiguous."""
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.compat.megatron_speed import rope_in_four_ops

    assert rope_in_four_ops()
    patched = rope_utils._apply_rotary_pos_emb_bshd
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, 2, 2, 4 * 8, generator=gen)  # 2 KV groups of 2 query heads, head dim 8
    freqs = torch.randn(6, 1, 1, 8, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        grads, outs = [], []
        for fn in (patched, patched.original):
            fused = qkv.to(dtype).clone().requires_grad_()
            q, k, _ = fused.split([16, 8, 8], dim=3)
            q = q.reshape(6, 2, 4, 8)
            assert not k.is_contiguous()
            out_q, out_k = fn(q, freqs, mscale=0.7), fn(k, freqs, mscale=0.7)
            (out_q.square().sum() + out_k.sum()).backward()
            outs.append((out_q.detach(), out_k.detach()))
            grads.append(fused.grad)
        assert all(torch.equal(a, b) for a, b in zip(*outs)) and torch.equal(*grads), dtype
        assert outs[0][1].is_contiguous() and outs[0][1].stride() == outs[1][1].stride()
