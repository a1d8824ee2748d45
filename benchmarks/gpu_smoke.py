"""GPU smoke check: megarl's CUDA-only paths on one GPU, in a few minutes. CI has no GPU: run it where one is.

Needs torch, transformers, megatron-core and megarl's light dependencies (omegaconf, PyYAML, tqdm, psutil,
safetensors; ``pip install --no-deps megatron-core==0.16.1 -e .``): the run uses ``rollout.backend=hf``, builtin data,
a built-in reward and no W&B, so vllm, pyarrow, wandb and matplotlib are never imported.

What it runs (the quickstart's tiny GRPO on a tiny Llama built here, world of 1 on NCCL, one `megarl train` process
each):
  A. 4 steps with the training state offloaded to pinned host memory while the engine generates, saving at 2 and 4;
  B. the same 4 steps without offload: every algorithmic metric equals A's (the offload round trip is exact);
  C. the same 4 steps as B, stopped after step 2 and resumed: steps 3 and 4 equal B's (the CUDA RNG state, which HF
     sampling draws from, went through the checkpoint);
  D. ``megarl plan``'s peak bytes for rank 0 against ``torch.cuda.max_memory_allocated`` of run B.

    python benchmarks/gpu_smoke.py             # prints one line per check, then PASS or FAIL
"""

from __future__ import annotations

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


def _train(model: str, out: str, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "megarl.cli", "train", "configs/quickstart.yaml", f"model.path={model}",
           f"trainer.output_dir={out}", *COMMON, *extra]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if run.returncode not in (0, 75):
        raise SystemExit(f"gpu_smoke: FAIL: `{' '.join(cmd)}` exited {run.returncode}:\n{run.stderr[-4000:]}")
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _algorithmic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NOT_ALGORITHMIC)} for r in rows]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA GPU here: not run")
        return 2
    from megarl.config import load_config, validate
    from megarl.models.tiny import make_tiny_hf_model
    from megarl.plan import default_hardware, make_plan

    name = torch.cuda.get_device_name()
    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_hf_model(os.path.join(tmp, "tiny"), "llama")
        a = _train(model, os.path.join(tmp, "a"), "trainer.total_steps=4", "offload.enable=true")
        b = _train(model, os.path.join(tmp, "b"), "trainer.total_steps=4")
        _train(model, os.path.join(tmp, "c"), "trainer.total_steps=2")
        c = _train(model, os.path.join(tmp, "c"), "trainer.total_steps=4")
        checks.append(("4 RL steps on NCCL (world 1), rewards finite", all(r["reward/mean"] == r["reward/mean"]
                                                                            for r in b)))  # fmt: skip
        checks.append(("offload to pinned host memory and back: metrics equal", _algorithmic(a) == _algorithmic(b)))
        checks.append(("resume from step 2 (CUDA RNG through the checkpoint): steps 3-4 equal",
                       _algorithmic(c)[2:] == _algorithmic(b)[2:]))  # fmt: skip
        cfg = load_config(os.path.join(REPO, "configs", "quickstart.yaml"), [f"model.path={model}", *COMMON])
        spec = validate(cfg)
        gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1024**3
        plan = make_plan(cfg, spec, default_hardware(1, 1, 1, gpu_mem_gb=gpu_gb))
        _, phase, planned = plan.worst()
        measured = max(r["memory/peak_gpu_gb"] for r in b) * 1024**3
        print(f"gpu_smoke: {name}; megarl plan: rank 0 peak {planned / 1e6:.1f} MB ({phase}); measured "
              f"torch.cuda.max_memory_allocated {measured / 1e6:.1f} MB (ratio {measured / planned:.2f})")  # fmt: skip
        checks.append(("the plan's peak is within 2x of the measured peak", 0.5 <= measured / planned <= 2.0))
    for what, ok in checks:
        print(f"gpu_smoke: {'ok  ' if ok else 'FAIL'} {what}")
    passed = all(ok for _, ok in checks)
    print("gpu_smoke: PASS" if passed else "gpu_smoke: FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
