"""The CPU shim, each patch exercised in a fresh interpreter (the shim is process-wide; keep pytest's clean)."""

import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shim applies only without CUDA")


def _run(code: str, env: dict | None = None) -> str:
    full_env = {k: v for k, v in os.environ.items() if k != "MEGARL_CPU_SHIM"}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_process_wide_stubs():
    assert (
        _run("""
        import torch
        from megarl.compat import cpu
        assert cpu.install_if_needed() and cpu.is_installed()
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.set_device(0)
        assert torch.cuda.device_count() == 1
        assert not torch.cuda.is_available()          # deliberately not stubbed
        torch.cuda.manual_seed(3)                      # must not recurse
        a = torch.rand(3)
        torch.manual_seed(3)
        assert torch.equal(a, torch.rand(3))
        state = torch.cuda.get_rng_state(); b = torch.rand(2); torch.cuda.set_rng_state(state)
        assert torch.equal(b, torch.rand(2))
        import os; assert os.environ["MEGARL_CPU_SHIM"] == "1"
        print("ok")
    """)
        == "ok"
    )


def test_megatron_rng_tracker_forks_on_cpu():
    assert (
        _run("""
        import torch
        from megarl.compat import cpu
        cpu.install()
        from megatron.core.tensor_parallel import random as r
        r.initialize_rng_tracker(force_reset=True)
        tracker = r.get_cuda_rng_tracker(); tracker.reset(); tracker.add("model-parallel-rng", 42)
        torch.manual_seed(0); before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        assert torch.equal(before, torch.get_rng_state())   # fork restores the default stream
        torch.manual_seed(42); assert torch.equal(a, torch.rand(4))
        print("ok")
    """)
        == "ok"
    )


def test_megatron_mode_maps_cuda_to_cpu_only_inside():
    assert (
        _run("""
        import torch
        from megarl.compat import cpu
        from megarl.compat.cpu import megatron_mode
        cpu.install()
        x = torch.ones(2)
        with megatron_mode():
            assert torch.zeros(2, device="cuda").device.type == "cpu"
            assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
            assert x.cuda() is x and x.to("cuda").device.type == "cpu"
            assert x.type() == "torch.cuda.FloatTensor" and x.half().type() == "torch.cuda.HalfTensor"
            assert torch.ones(2, pin_memory=True).device.type == "cpu"
        assert x.type() == "torch.FloatTensor"
        try:
            torch.zeros(2, device="cuda")
        except (AssertionError, RuntimeError):
            print("ok")
    """)
        == "ok"
    )


def test_spawned_children_reinstall_from_env():
    assert _run("import megarl, torch; print(torch.cuda.current_device())", {"MEGARL_CPU_SHIM": "1"}) == "cpu"
    assert _run("import megarl, torch; from megarl.compat import cpu; print(cpu.is_installed())") == "False"


def test_megatron_needs_the_mode():
    """Without the mode, Megatron's hard-coded CUDA tensors fail on CPU (so the shim is not dead code)."""
    assert (
        _run("""
        import torch
        from megarl.compat import cpu
        from megarl.compat.cpu import megatron_mode
        cpu.install()
        try:
            torch.tensor([1.0], device="cuda")      # what FP32Optimizer.__init__ does
            print("no error")
        except (AssertionError, RuntimeError):
            with megatron_mode():
                torch.tensor([1.0], device="cuda")
            print("ok")
    """)
        == "ok"
    )


def test_keep_freed_memory_reuses_freed_blocks_without_page_faults():
    """glibc gives freed blocks over its mmap threshold back to the kernel and the next ones fault in every page;
    with ``keep_freed_memory`` they stay in the process: once the heap has grown to hold them, allocating the same
    blocks again touches pages that are already there. Page faults are counted by the kernel (``getrusage``)."""
    out = _run(
        """
        import ctypes, resource
        ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, whatever the host's THP mode
        import torch
        from megarl.compat.host_memory import keep_freed_memory

        def faults_of_blocks(mb=40, count=4):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [torch.ones(mb * 2**20 // 4) for _ in range(count)]  # written: every page touched
            del blocks
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        returned = [faults_of_blocks() for _ in range(3)]
        assert keep_freed_memory()
        kept = [faults_of_blocks() for _ in range(4)][1:]  # the first grows the heap
        print(min(returned), min(kept))
    """,
        env={"THP_MEM_ALLOC_ENABLE": "0"},
    )
    returned, kept = map(int, out.split())
    pages = 4 * 40 * 2**20 // 4096
    assert returned > pages // 2, (returned, kept)  # glibc's default: fresh pages every time
    assert kept < pages // 100, (returned, kept)  # reused


def test_grad_clipping_scales_in_place_and_takes_the_norm_like_megatrons_local_fallbacks():
    """``multi_tensor_fallbacks_in_place``: Megatron's clipping (``clip_grad_by_total_norm_fp32``) multiplies every
    gradient in place, to the same values as its local fallback's ``dst.copy_(src * scale)``, and the norm equals its
    local ``multi_tensor_l2_norm``; the mixed-precision optimizer's copy of fp32 main parameters into bf16 model ones
    is bitwise the fallback's, into the same storage, without it (no ``src * 1.0`` temporaries)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from megarl.compat.cpu import CudaToCpuMode
    from megarl.compat.megatron_speed import multi_tensor_fallbacks_in_place

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for shape in ((64, 32), (7,), (3, 5, 2))]
    reference = [g.clone() for g in grads]
    assert multi_tensor_fallbacks_in_place() and multi_tensor_fallbacks_in_place()  # idempotent
    pointers = [g.data_ptr() for g in grads]
    clip_grads.multi_tensor_scale_impl(0, None, [grads, grads], 0.3)
    utils.local_multi_tensor_scale(0, None, [reference, reference], 0.3)
    assert all(torch.equal(g, r) for g, r in zip(grads, reference)) and [g.data_ptr() for g in grads] == pointers
    norm, _ = clip_grads.l2_norm_impl(0, None, [grads], False)
    with CudaToCpuMode():  # the fallback puts its result on device='cuda'
        expected, _ = utils.local_multi_tensor_l2_norm(0, None, [grads], False)
    assert norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.allclose(norm, expected.to(norm.device), rtol=1e-6), (norm, expected)

    from megatron.core.optimizer import optimizer as mixed

    main = [g * 1.37 for g in grads]
    model = [torch.zeros_like(m, dtype=torch.bfloat16) for m in main]
    pointers = [m.data_ptr() for m in model]
    expected = [torch.zeros_like(m) for m in model]
    utils.local_multi_tensor_scale(0, None, [main, expected], 1.0)
    with mock.patch.object(torch, "_foreach_copy_", wraps=torch._foreach_copy_) as one_copy:
        mixed._multi_tensor_copy_this_to_that(main, model, overflow_buf=torch.zeros(1, dtype=torch.int))
    assert one_copy.call_count == 1  # not the fallback's product and copy per tensor
    assert all(torch.equal(m, e) for m, e in zip(model, expected, strict=True))
    assert [m.data_ptr() for m in model] == pointers and all(m.dtype == torch.bfloat16 for m in model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_without_communication_is_megatrons_linear_bitwise(dtype):
    """``linear_without_communication``: Megatron's linear layers' function, where it communicates nothing, is
    ``_LinearWithoutCommunication``: output and input, weight (or ``main_grad``, accumulated into) and bias
    gradients bitwise Megatron's, with and without bias and the fused weight-gradient accumulation; DDP's hook gets
    Megatron's placeholder gradient; a call that defers weight gradients keeps Megatron's function."""
    from megatron.core.tensor_parallel import layers

    from megarl.compat.megatron_speed import _WeightGradientAccumulation, linear_without_communication

    assert linear_without_communication() and linear_without_communication()  # idempotent
    patched = layers.linear_with_grad_accumulation_and_async_allreduce
    megatrons = patched.original
    gen = torch.Generator().manual_seed(0)
    x0, w0, b0, g = (torch.randn(shape, generator=gen).to(dtype) for shape in ((5, 2, 8), (6, 8), (6,), (5, 2, 6)))
    fused = _WeightGradientAccumulation  # apex's extension where it is installed: what Megatron calls
    with mock.patch.object(layers, "fused_weight_gradient_mlp_cuda", fused, create=True):
        for fusion in (False, True):
            for bias in (False, True):
                results, nodes = [], []
                for linear in (patched, megatrons):
                    x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
                    b = torch.nn.Parameter(b0.clone()) if bias else None
                    if fusion:
                        w.main_grad = torch.full((6, 8), 0.5)  # fp32, accumulated into
                    out = linear(x, w, b, fusion, False, False)
                    out.backward(g)
                    nodes.append(type(out.grad_fn).__name__)
                    results.append((out, x.grad, w.main_grad if fusion else w.grad, b.grad if bias else x.grad))
                assert nodes == ["LinearWithoutCommunicationBackward",
                                 "LinearWithGradAccumulationAndAsyncCommunicationBackward"]  # fmt: skip
                ours, theirs = results
                assert all(a.dtype == e.dtype and torch.equal(a, e) for a, e in zip(ours, theirs)), (fusion, bias)
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        w.main_grad, w.grad_added_to_main_grad = torch.zeros(6, 8), False  # as DDP sets them
        patched(x, w, None, True, False, False).backward(g)
        assert w.grad_added_to_main_grad and w.grad.shape == (6, 8) and w.grad.dtype == dtype  # the placeholder
        deferred = patched(x0.clone().requires_grad_(), w, None, False, False, False, grad_output_buffer=[])
        assert type(deferred.grad_fn).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"
        w.zero_out_wgrad = True  # Megatron reads it with a fused gradient only (a tied output layer sets it)
        names = [type(patched(x0, w, None, fusion, False, False).grad_fn).__name__ for fusion in (False, True)]
        assert names == ["LinearWithoutCommunicationBackward",
                         "LinearWithGradAccumulationAndAsyncCommunicationBackward"]  # fmt: skip


def test_fused_adam_takes_torchs_default_steps_in_one_kernel():
    """``fused_adam``: the torch Adam inside a Megatron optimizer (``.optimizer``; chained:
    ``.chained_optimizers``) runs fused where its parameters are on the CPU: parameters and moments equal to torch's
    default implementation's within about one ulp (fp32, as Megatron's inner optimizer holds: the main copies of a
    bf16 model). SGD is left as is; a group on a device without torch's fused kernel (the meta device) gets torch's
    default back, as after loading a CPU run's checkpoint there; a GPU's group runs fused, its steps on its device;
    a load, which takes the saved flags, is undone by calling it again.

    In one intra-op thread: run after tests/test_models.py, test_placement.py and test_lora.py in one process, torch's
    default AdamW on the same inputs twice once differed from itself (in 52,762 of the 65,536 elements the second
    thread computes, none of the first thread's; up to 4.77e-7, 2,621 elements outside the tolerance below): the
    test compares the two implementations, not that thread's state."""
    from types import SimpleNamespace

    from megarl.compat.megatron_speed import fused_adam

    def run(cls, fused: bool):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((256, 512), (7,), (3, 5, 2))]
        inner = cls(params, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95), eps=1e-8)
        switched = fused_adam(SimpleNamespace(optimizer=inner)) if fused else 0
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            inner.step()
        return switched, inner, params

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for cls in (torch.optim.AdamW, torch.optim.Adam):
            switched, fused, fused_params = run(cls, True)
            _, default, default_params = run(cls, False)
            assert switched == 1 and fused.param_groups[0]["fused"] and not fused.param_groups[0]["foreach"]
            for a, b in zip(fused_params, default_params, strict=True):
                assert torch.allclose(a, b, rtol=5e-7, atol=1e-7), (a - b).abs().max()  # an ulp or two
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.allclose(fused.state[a][key], default.state[b][key], rtol=1e-6, atol=1e-9), key
            assert float(fused.state[fused_params[0]]["step"]) == 5
            default.load_state_dict(default.state_dict())
            reloaded = SimpleNamespace(optimizer=fused)
            fused.load_state_dict(default.state_dict())  # a checkpoint of torch's default: its flags come along
            assert fused.param_groups[0]["fused"] is None and fused_adam(reloaded) == 1
            assert fused.param_groups[0]["fused"]
    finally:
        torch.set_num_threads(threads)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    elsewhere = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))], lr=0.1)
    elsewhere.param_groups[0]["fused"] = True  # loaded from a CPU run's checkpoint onto a device without the kernel
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=sgd), SimpleNamespace(optimizer=elsewhere)])
    assert fused_adam(chained) == 0 and elsewhere.param_groups[0]["fused"] is None
    # a GPU's parameters run fused too (a stand-in: the choice reads the parameters' device only); a step kept on
    # the host (torch's default keeps it there) moves to its parameter's device, where the fused kernel reads it
    on_gpu = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    on_gpu.param_groups[0]["params"] = [type("OnGpu", (), {"device": torch.device("cuda", 0)})()]
    assert fused_adam(SimpleNamespace(optimizer=on_gpu)) == 1 and on_gpu.param_groups[0]["fused"]
    assert on_gpu.param_groups[0]["foreach"] is False
    param = torch.nn.Parameter(torch.zeros(3, device="meta"))
    loaded = torch.optim.AdamW([param], lr=0.1)
    loaded.state[param]["step"] = torch.tensor(4.0, dtype=torch.float64)
    with mock.patch("megarl.compat.megatron_speed.FUSED_ADAM_DEVICES", ("meta",)):
        assert fused_adam(SimpleNamespace(optimizer=loaded)) == 1
    step = loaded.state[param]["step"]
    assert step.device.type == "meta" and step.dtype == torch.float32
    on_cpu = torch.nn.Parameter(torch.zeros(3))
    loaded = torch.optim.AdamW([on_cpu], lr=0.1)
    loaded.state[on_cpu]["step"] = torch.tensor(4.0, dtype=torch.float64)  # the kernel would read fp64 bytes as fp32
    assert fused_adam(SimpleNamespace(optimizer=loaded)) == 1 and loaded.state[on_cpu]["step"].dtype == torch.float32
