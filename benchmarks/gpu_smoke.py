"""GPU smoke check: megarl's CUDA-only paths on one GPU, in bf16 (the production dtype), in a few minutes. CI has no
GPU: run it where one is.

Needs torch, transformers, megatron-core and megarl's light dependencies (omegaconf, PyYAML, tqdm, psutil,
safetensors; ``pip install --no-deps megatron-core==0.16.1 -e .``): the runs use ``rollout.backend=hf``, builtin data,
built-in rewards and no W&B, so vllm, pyarrow, wandb and matplotlib are never imported.

What it runs (tiny Llamas built here, world of 1 on NCCL, one `megarl train` process each, ``--dtype`` bf16 by
default):
  A. GRPO, 4 steps with the training state offloaded to pinned host memory while the engine generates, saving at 2
     and 4 (bf16 checkpoints);
  B. the same 4 steps without offload: every algorithmic metric equals A's (the offload round trip is exact);
  C. the same 4 steps as B, stopped after step 2 and resumed: steps 3 and 4 equal B's (the bf16 checkpoint and the
     CUDA RNG state, which HF sampling draws from, went through it);
  D. PPO with a critic (GAE) and a KL loss to the reference, 3 steps, saved and resumed after step 2: values and KL
     finite, steps 3 equal;
  E. LoRA (rank 8, merged into the HF engine), 3 steps saved and resumed after 2: the adapters train, step 3 equal;
  F. a reward model (a tiny ``LlamaForSequenceClassification``) combined with the reward function, 2 steps;
  G. the exact parts of ``megarl plan`` (actor parameters, gradient buffers, optimizer state: bf16 parameters, fp32
     main parameters, gradients and Adam moments) against ``torch.cuda.memory_allocated`` of the actor built, wrapped
     and stepped once in a fresh process, on a model large enough to measure (~64M parameters; torch's caching
     allocator may count up to 1 MiB more per tensor); in the same process,
     the weight sync's transfer device under the default group (``cpu:gloo,cuda:nccl``) is the GPU;
  H. a 1.2B Llama (hidden 2048, 16 layers, 16 heads / 8 KV, FFN 5632, vocab 32000), one GRPO step with the HF engine
     (16 prompts x 8 samples, 64 new tokens): its per-phase times are printed;
  I. the actor update at that 1.2B shape (16 x 2048 tokens, micro-batches of 2, bf16, sdpa attention), as
     ``benchmarks/train_step.py`` runs it: ``megarl plan``'s training peak for the actor (parameters, gradient buffer,
     optimizer state, activations saved for backward, the logits around the loss) within 20% of
     ``torch.cuda.max_memory_allocated`` over a step;
  J. one micro-batch's forward and backward of that actor at 2048, 8192 and 16384 tokens (sequences of 2048), after
     an optimizer step: the peak allocated on top of what was allocated before (as ../shared/facts/
     gpu-h100-first-contact.md measured it) within 20% of the plan's activations plus logits for that budget;
  K. ``megarl.compat.megatron_speed.rope_in_four_ops`` on CUDA tensors: forward and input gradient bitwise equal
     to megatron-core's RoPE in fp32 and bf16 (passed on an H100 with its earlier, in-place version).

    python benchmarks/gpu_smoke.py [--dtype bfloat16|float32]   # one line per check, then PASS or FAIL
    python benchmarks/gpu_smoke.py --groups J,K                  # only these groups (several processes may share a
                                                                 # GPU: each run picks its own port)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

NOT_ALGORITHMIC = ("timing/", "perf/", "memory/", "sync/seconds", "rollout/tokens_per_s")
COMMON = ["actor.parallel.tp=1", "rollout.backend=hf", "trainer.val_every=0", "logging.wandb.mode=disabled",
          "logging.progress_bar=false", "data.train_batch_size=4", "rollout.sampling.n=4", "actor.global_batch_size=16",
          "rollout.sampling.max_new_tokens=8", "trainer.save_every=2"]  # fmt: skip
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUPS = ("I", "J", "H", "G", "A-C", "D", "E", "F", "K")
"""All groups, the 1.2B ones first (a run stopped by a time limit has the slowest answers)."""
ALLOCATOR_SLACK = 1 << 20
"""What torch's CUDA caching allocator may count beyond a tensor's bytes: a tensor over 1 MiB that starts a segment
gets the whole segment when the remainder is at most 1 MiB (not split off). Seen on an H100: the ~64M model's four
11 MiB fc1 weights took 12 MiB each (+4 MiB, 3.3% of its 128 MB), fc2's fp32 copies and moments likewise (+12 MiB)."""


def _train(recipe: str, model: str, out: str, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "megarl.cli", "train", recipe, f"model.path={model}", f"trainer.output_dir={out}",
           *COMMON, *extra]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if run.returncode not in (0, 75):
        raise SystemExit(f"gpu_smoke: FAIL: `{' '.join(cmd)}` exited {run.returncode}:\n{run.stderr[-4000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _algorithmic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NOT_ALGORITHMIC)} for r in rows]


def _finite(rows: list[dict], *keys: str) -> bool:
    return all(k in r and r[k] == r[k] and abs(r[k]) != float("inf") for r in rows for k in keys)


def _resumed(recipe: str, model: str, out: str, steps: int, *extra: str) -> tuple[list[dict], list[dict]]:
    """An uninterrupted run of ``steps`` and one stopped after step 2 and resumed: both metric histories."""
    whole = _train(recipe, model, out + "-whole", f"trainer.total_steps={steps}", *extra)
    _train(recipe, model, out + "-cut", "trainer.total_steps=2", *extra)
    return whole, _train(recipe, model, out + "-cut", f"trainer.total_steps={steps}", *extra)


def measure_exact_parts(recipe: str, overrides: list[str]) -> dict:
    """Collective (world 1 here): the actor built as `megarl train` builds it, wrapped in DDP with its optimizer and
    stepped once (Adam's moments exist), each part measured with ``torch.cuda.memory_allocated``; with the plan's."""
    import torch

    from megarl.backend.offload import ACTOR_GRADS, ACTOR_OPTIMIZER
    from megarl.backend.setup import wrap_for_training
    from megarl.compat.cpu import megatron_mode
    from megarl.config import load_config, validate
    from megarl.models.builder import build_model_chunk
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner.memory import rank_memory

    cfg = load_config(recipe, overrides)
    spec = validate(cfg)
    layout = ParallelLayout()
    init_distributed(layout)
    import torch.distributed as dist

    from megarl.reshard.executor import comm_device

    sync = {"backend": str(dist.get_backend()), "device": str(comm_device())}
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    chunk = build_model_chunk(spec, layout, dtype=cfg.model.dtype, init_weights=True)
    params = torch.cuda.memory_allocated() - start
    ddp, optimizer = wrap_for_training(chunk, cfg.actor.optim)
    for p in ddp.parameters():
        p.main_grad.normal_()  # a gradient, so that the step runs Adam (its moments are allocated at the first step)
    with megatron_mode():  # nothing on CUDA (the CPU shim's scope otherwise)
        optimizer.step()
    torch.cuda.synchronize()
    rest = torch.cuda.memory_allocated() - start - params
    planned = rank_memory(cfg, spec, layout, gpus_per_node=1)[0].consumers
    tensors = len(list(chunk.parameters()))  # each a tensor of its own; Adam adds a main copy and two moments
    return {"sync": sync, "measured": {"actor params": params, "grads+optimizer": rest},
            "tensors": {"actor params": tensors, "grads+optimizer": 3 * tensors + len(ddp.buffers)},
            "planned": {"actor params": planned["actor params"],
                        "grads+optimizer": planned[ACTOR_GRADS] + planned[ACTOR_OPTIMIZER]}}  # fmt: skip


def _plan_1_2b(hf_dir: str, micro_batch_tokens: int) -> dict:
    """The plan's consumers of rank 0 for the 1.2B actor (bf16, TP=1, sequences of 2048) at a micro-batch budget."""
    from megarl.config import load_config, validate
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner.memory import rank_memory

    overrides = [f"model.path={hf_dir}", "model.dtype=bfloat16", "actor.parallel.tp=1", "actor.seq_length=2048",
                 f"actor.max_tokens_per_micro_batch={micro_batch_tokens}", "rollout.backend=hf",
                 "rollout.max_model_len=2048"]  # fmt: skip
    cfg = load_config(os.path.join(REPO, "configs/quickstart.yaml"), overrides, cuda=True)
    return rank_memory(cfg, validate(cfg), ParallelLayout(), gpus_per_node=1)[0].consumers


def measure_training_peak(hf_dir: str) -> dict:
    """World 1: the actor update of ``benchmarks/train_step.py`` at 16 x 2048 tokens, its peak over one step after a
    warm-up step; and the plan's training-phase bytes of the same actor (no engine, no reserve: not allocated here)."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from train_step import megarl_step

    from megarl.backend.offload import ACTOR_GRADS, ACTOR_OPTIMIZER
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner.memory import ACTIVATIONS, LOGITS

    init_distributed(ParallelLayout())
    step, _ = megarl_step(hf_dir, "sdpa", "bfloat16", sequences=16, length=2048, micro=2)
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    consumers = _plan_1_2b(hf_dir, 4096)
    parts = ("actor params", ACTOR_GRADS, ACTOR_OPTIMIZER, ACTIVATIONS, LOGITS)
    return {"measured": torch.cuda.max_memory_allocated(), "planned": {k: consumers[k] for k in parts}}


MICRO_BATCH_TOKENS = (2048, 8192, 16384)


def measure_micro_batch_peaks(hf_dir: str) -> dict:
    """World 1: for each budget of ``MICRO_BATCH_TOKENS``, one micro-batch's forward and backward of the 1.2B actor
    (sdpa, bf16; gradient buffer and Adam state in place after one step), the peak allocated minus what was
    allocated before; with the plan's activations and logits for that budget."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from train_step import megarl_actor

    from megarl.backend.step import SUM, forward_backward, train_step
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner.memory import ACTIVATIONS, LOGITS

    init_distributed(ParallelLayout())
    most = max(MICRO_BATCH_TOKENS) // 2048
    model, optimizer, (batch,), loss, _ = megarl_actor(hf_dir, "sdpa", "bfloat16", most, 2048, most)
    train_step(model, optimizer, [batch], loss, reduce=SUM)
    got = {}
    for tokens in MICRO_BATCH_TOKENS:
        rows = tokens // 2048
        micro = {k: v[:rows] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward(model, [micro], loss, reduce=SUM)
        torch.cuda.synchronize()
        consumers = _plan_1_2b(hf_dir, tokens)
        got[tokens] = {"measured": torch.cuda.max_memory_allocated() - before,
                       "activations": consumers[ACTIVATIONS], "logits": consumers[LOGITS]}  # fmt: skip
    return got


def _in_fresh_process(fn, *args):
    """``fn(*args)`` as rank 0 of a world of 1 in a new process: a measurement of ``torch.cuda`` memory starts from
    nothing, and this process keeps no process group (whose port and RANK the `megarl train` children would inherit)."""
    import concurrent.futures
    import multiprocessing

    from megarl.parallel.spawn import run_on_ranks

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_on_ranks, fn, 1, *args).result()


def _training_peak_at_1_2b(path) -> tuple[str, bool]:
    got = _in_fresh_process(measure_training_peak, path("1.2b"))  # the model of _make_1_2b
    planned = sum(got["planned"].values())
    print(f"gpu_smoke: 1.2B actor update peak {got['measured'] / 1e9:.2f} GB measured, {planned / 1e9:.2f} GB planned ("
          + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in got["planned"].items()) + ")")  # fmt: skip
    return "megarl plan's training peak of the 1.2B actor update within 20%", abs(got["measured"] / planned - 1) <= 0.2


def _micro_batch_peaks_at_1_2b(path) -> list[tuple[str, bool]]:
    """J."""
    checks = []
    for tokens, got in _in_fresh_process(measure_micro_batch_peaks, path("1.2b")).items():
        planned = got["activations"] + got["logits"]
        print(f"gpu_smoke: 1.2B micro-batch of {tokens} tokens: forward + backward {got['measured'] / 1e9:.2f} GB "
              f"measured, {planned / 1e9:.2f} GB planned (activations {got['activations'] / 1e9:.2f}, logits "
              f"{got['logits'] / 1e9:.2f}; ratio {got['measured'] / planned:.4f})")  # fmt: skip
        checks.append((f"megarl plan's activations + logits of a {tokens}-token micro-batch within 20%",
                       abs(got["measured"] / planned - 1) <= 0.2))  # fmt: skip
    return checks


def _rope_on_cuda(device: str = "cuda") -> list[tuple[str, bool]]:
    """K (``device`` another one only to try the check itself)."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.compat.megatron_speed import rope_in_four_ops

    if not rope_in_four_ops():
        return [("megarl's RoPE applies to this megatron-core", False)]
    patched = rope_utils._apply_rotary_pos_emb_bshd
    gen = torch.Generator(device).manual_seed(0)
    t, grad = (torch.randn(2048, 2, 16, 128, generator=gen, device=device) for _ in range(2))
    freqs = torch.randn(2048, 1, 1, 128, generator=gen, device=device)
    checks = []
    for dtype in (torch.float32, torch.bfloat16):
        outs = []
        for fn in (patched, patched.original):
            x = t.to(dtype).clone().requires_grad_()
            out = fn(x, freqs, mscale=0.7)
            out.backward(grad.to(dtype))
            outs.append((out.detach(), x.grad))
        (out, dx), (ref, ref_dx) = outs
        same = torch.equal(out, ref) and torch.equal(dx, ref_dx)
        checks.append((f"RoPE in four ops on {device}, {dtype}: output and gradient bitwise Megatron's",
                       out.device.type == device and out.dtype == dtype and same))
    return checks


def _make_1_2b(path) -> str:
    """The 1.2B Llama of ``configs/models/llama-1.2b`` with random weights, built here once for H and I."""
    from megarl.models.tiny import make_tiny_hf_model

    return make_tiny_hf_model(path("1.2b"), "llama", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8,
                              ffn_hidden_size=5632, vocab_size=32000, max_position_embeddings=2048)  # fmt: skip


def _step_at_1_2b(path) -> list[tuple[str, bool]]:
    """H. One GRPO step of the 1.2B Llama with the HF engine (16 prompts x 8, 64 new tokens); prints its phases."""
    (row,) = _train("configs/quickstart.yaml", path("1.2b"), path("1.2b-run"), "trainer.total_steps=1",
                    "trainer.save_every=0", "model.dtype=bfloat16", "data.train_batch_size=16", "rollout.sampling.n=8",
                    "actor.global_batch_size=128", "rollout.sampling.max_new_tokens=64", "actor.seq_length=128",
                    "rollout.max_model_len=128", "actor.max_tokens_per_micro_batch=4096")  # fmt: skip
    phases = {k.removeprefix("timing/"): v for k, v in row.items() if k.startswith("timing/")}
    print("gpu_smoke: 1.2B GRPO step (HF engine, 16x8 samples, 64 new tokens): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))  # fmt: skip
    return [("a 1.2B step with the HF engine: rewards finite", _finite([row], "reward/mean"))]


def _grpo_offload_resume(path, model, dtype) -> list[tuple[str, bool]]:
    """A, B, C."""
    grpo = "configs/quickstart.yaml"
    a = _train(grpo, model, path("a"), "trainer.total_steps=4", "offload.enable=true", f"model.dtype={dtype}")
    b, c = _resumed(grpo, model, path("b"), 4, f"model.dtype={dtype}")
    return [(f"4 GRPO steps on NCCL (world 1, {dtype}), rewards finite", _finite(b, "reward/mean")),
            ("offload to pinned host memory and back: metrics equal", _algorithmic(a) == _algorithmic(b)),
            (f"resume from step 2 ({dtype} checkpoint, CUDA RNG): steps 3-4 equal",
             _algorithmic(c)[2:] == _algorithmic(b)[2:])]  # fmt: skip


def _ppo(path, model, dtype) -> list[tuple[str, bool]]:
    """D."""
    whole, cut = _resumed("configs/tiny_ppo.yaml", model, path("ppo"), 3, f"model.dtype={dtype}")
    return [("PPO with critic and reference: values, KL finite; resumed step 3 equal",
             _finite(whole, "critic/values_mean", "critic/vf_loss", "actor/kl_loss")
             and _algorithmic(cut)[2:] == _algorithmic(whole)[2:])]  # fmt: skip


def _lora(path, dtype) -> list[tuple[str, bool]]:
    """E."""
    from megarl.models.tiny import make_tiny_hf_model

    model = make_tiny_hf_model(path("tiny-lora"), "llama", init_std=0.08)
    whole, cut = _resumed("configs/quickstart.yaml", model, path("lora"), 3, f"model.dtype={dtype}",
                          "actor.lora.rank=8", "actor.optim.lr=0.001")  # fmt: skip
    return [("LoRA (merged into the engine): adapters train; resumed step 3 equal",
             all(r["actor/grad_norm"] > 0 for r in whole) and _algorithmic(cut)[2:] == _algorithmic(whole)[2:])]


def _reward_model(path, model, dtype) -> list[tuple[str, bool]]:
    """F."""
    from megarl.models.tiny import make_tiny_hf_model

    rm = make_tiny_hf_model(path("rm"), "llama", seed=7, init_std=0.08, num_labels=1)
    rows = _train("configs/quickstart.yaml", model, path("rm-run"), "trainer.total_steps=2", f"model.dtype={dtype}",
                  f"reward.model.path={rm}")  # fmt: skip
    return [("a reward model scores beside the function: rewards finite", _finite(rows, "reward/mean"))]


def _exact_parts(path, dtype) -> list[tuple[str, bool]]:
    """G."""
    import torch

    from megarl.models.tiny import make_tiny_hf_model

    big = make_tiny_hf_model(path("big"), "llama", hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=8,
                             ffn_hidden_size=2816, vocab_size=8192)  # fmt: skip
    parts = _in_fresh_process(measure_exact_parts, os.path.join(REPO, "configs/quickstart.yaml"),
                              [f"model.path={big}", f"model.dtype={dtype}", *COMMON])  # fmt: skip
    print(f"gpu_smoke: weight sync under the {parts['sync']['backend']} default group moves buffers on "
          f"{parts['sync']['device']}")  # fmt: skip
    checks = [("the weight sync's buffers and hashes are on the GPU", parts["sync"]["device"].startswith("cuda"))]
    for part, planned in parts["planned"].items():
        measured = parts["measured"][part]
        print(f"gpu_smoke: {torch.cuda.get_device_name()}: {part}: planned {planned / 1e6:.2f} MB, allocated "
              f"{measured / 1e6:.2f} MB (ratio {measured / planned:.4f})")  # fmt: skip
        rounding = parts["tensors"][part] * ALLOCATOR_SLACK
        checks.append((f"megarl plan's {part} equal what the run allocated (within 1% or the allocator's rounding)",
                       abs(measured / planned - 1) <= 0.01 or 0 <= measured - planned <= rounding))  # fmt: skip
    return checks


def main() -> int:
    import time

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--groups", default=",".join(GROUPS), help="comma-separated groups to run, in this order")
    args = parser.parse_args()
    wanted = args.groups.split(",")
    if set(wanted) - set(GROUPS):
        parser.error(f"unknown groups {sorted(set(wanted) - set(GROUPS))}: choose from {', '.join(GROUPS)}")
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA GPU here: not run")
        return 2
    from megarl.models.tiny import make_tiny_hf_model

    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        path = lambda name: os.path.join(tmp, name)  # noqa: E731
        model = make_tiny_hf_model(path("tiny"), "llama")
        if {"H", "I", "J"} & set(wanted):
            _make_1_2b(path)
        groups = {"I": lambda: [_training_peak_at_1_2b(path)], "J": lambda: _micro_batch_peaks_at_1_2b(path),
                  "H": lambda: _step_at_1_2b(path), "G": lambda: _exact_parts(path, args.dtype),
                  "A-C": lambda: _grpo_offload_resume(path, model, args.dtype),
                  "D": lambda: _ppo(path, model, args.dtype), "E": lambda: _lora(path, args.dtype),
                  "F": lambda: _reward_model(path, model, args.dtype), "K": _rope_on_cuda}  # fmt: skip
        for name, group in ((n, groups[n]) for n in wanted):  # 1.2B checks first; a broken check costs its group
            start = time.perf_counter()
            try:
                done = group()
            except (Exception, SystemExit) as err:
                print(f"gpu_smoke: {name} broke: {err}")
                done = [(f"{name} ran", False)]
            for what, ok in done:  # as each group ends: a run stopped by a time limit still shows what passed
                print(f"gpu_smoke: {name}: {'ok  ' if ok else 'FAIL'} {what}")
            checks += done
            print(f"gpu_smoke: {name} took {time.perf_counter() - start:.0f} s", flush=True)
    for what, ok in checks:
        print(f"gpu_smoke: {'ok  ' if ok else 'FAIL'} {what}")
    passed = all(ok for _, ok in checks)
    print("gpu_smoke: PASS" if passed else "gpu_smoke: FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
